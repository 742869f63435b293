"""TranslationModule: the Transformer trained with label smoothing, AdamW, and a warm-up followed by
an inverse-sqrt decay or a linear decay to zero at the end of the run's budget (training/schedule.py;
the random state a resume restores: training/resume.py).

Its typed keyword arguments are the `model:` section of a LightningCLI config: `transformer` is the
TransformerConfig itself (the model's one schema; its `vocab_size` is not written in configs, fit.py
links it from the data module's tokenizer), `val_search` the SearchConfig validation decodes with.
The other hyperparameters are checked at construction, each error naming its key (`model.lr`).

Validation computes the loss and perplexity on teacher-forced batches and decodes the validation
set with `search.decode` (greedy by default), then scores the detokenised output with
sacreBLEU and chrF against the raw references. Under DDP each rank decodes its share; the
hypotheses are gathered, deduplicated by sentence index (the data module pads ranks to equal batch
counts with repeated batches) and scored once over the whole set. torchmetrics' SacreBLEUScore would
sync n-gram counts instead, counting those repeated sentences twice, and gives no signature.

Every checkpoint carries what inference needs under the key "seq2seq", written by checkpoint.py
(model config, tokenizer proto bytes, language pair, a checksum), as plain types: it loads with
`torch.load(..., weights_only=True)`.
"""

import copy
import math
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal, get_args

import lightning as L
import sacrebleu
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info
from torch import Tensor

from seq2seq.checkpoint import CHECKPOINT_KEY, inference_entry, seal_training_state
from seq2seq.decoding.config import SearchConfig
from seq2seq.decoding.search import decode
from seq2seq.model import ConfigError, Transformer, TransformerConfig
from seq2seq.model.config import check_range
from seq2seq.precision import autocast_dtype, device_name
from seq2seq.text.tokenizer import Tokenizer
from seq2seq.training.budget import CPU_MAX_TOKENS, accumulation, size_budget
from seq2seq.training.compiled import compile_hidden_states
from seq2seq.training.loss import HiddenStates, label_smoothed_nll, training_loss
from seq2seq.training.machine import MachineTuning, choose_compiled_step
from seq2seq.training.pretrained import fine_tuning_config, load_pretrained
from seq2seq.training.resume import RNG_KEY, gather_rng_states, restore_rng_state
from seq2seq.training.schedule import LinearBudget, LinearToZero, LrSchedule, multiplier

# ((direction, sentence index), hypothesis, reference, summed smoothed loss, summed NLL, target tokens)
BUDGET_KEY = "seq2seq_max_tokens"  # in a checkpoint: the token budget its run trained with (data.max_tokens auto)
ValidationRow = tuple[tuple[int, int], str, str, float, float, int]
VAL_SEARCH = SearchConfig(beam_size=1)  # greedy: fast enough to run at every validation


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite: the run stops rather than train (and checkpoint) garbage."""


def check_hyperparameters(*, val_search: SearchConfig, label_smoothing: float, lr: float,
                          lr_schedule: str, warmup_steps: int, weight_decay: float,
                          adam_betas: tuple[float, float], adam_eps: float) -> None:
    """ConfigError naming the config key (`model.lr`) for a value that would train wrongly or not at all.

    What SearchConfig accepts but training does not: sampling for validation. fit.py calls this before
    any data work, the module again when it is built. (The pad id must be the tokenizer's: checked in
    setup, where the tokenizer is known, and by fit.py before, for the tokenizer it will train.)
    """
    if val_search.sampling:
        raise ConfigError("model.val_search.sampling", "validation BLEU needs a deterministic search: set it false")
    values = SimpleNamespace(label_smoothing=label_smoothing, lr=lr, warmup_steps=warmup_steps,
                             weight_decay=weight_decay, beta1=adam_betas[0], beta2=adam_betas[1], adam_eps=adam_eps)
    bounds: dict[str, dict[str, Any]] = {
        "label_smoothing": {"low": 0, "high": 1, "high_open": True},
        "lr": {"low": 0, "low_open": True},
        "warmup_steps": {"low": 1},  # 0 would divide by zero, and the schedule would hold the rate at 0
        "weight_decay": {"low": 0},
        "beta1": {"low": 0, "high": 1, "high_open": True},
        "beta2": {"low": 0, "high": 1, "high_open": True},
        "adam_eps": {"low": 0, "low_open": True},
    }
    for name, limits in bounds.items():
        try:
            check_range(values, name, **limits)
        except ConfigError as error:
            key = f"model.adam_betas[{name[-1] == '2':d}]" if name.startswith("beta") else f"model.{name}"
            raise ConfigError(key, error.problem) from None
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int):
        raise ConfigError("model.warmup_steps", f"must be a whole number of updates, got {warmup_steps!r}")
    if lr_schedule not in get_args(LrSchedule):
        raise ConfigError("model.lr_schedule",
                          f"must be one of {', '.join(get_args(LrSchedule))}, got {lr_schedule!r}")


class TranslationModule(L.LightningModule):
    def __init__(
        self,
        *,
        transformer: TransformerConfig,
        label_smoothing: float = 0.1,
        lr: float = 5e-4,
        lr_schedule: LrSchedule = "inverse_sqrt",
        warmup_steps: int = 4000,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.98),
        adam_eps: float = 1e-9,
        val_search: SearchConfig = VAL_SEARCH,
        init_from: str | None = None,
        compile: bool | Literal["auto"] = "auto",
        tokens_per_update: int | None = None,
        fp32_residual: bool = False,
        rdrop_alpha: float = 0.0,
    ):
        """
        Args:
            transformer: the model (seq2seq/model/config.py documents each field); its vocab_size
                is linked from the data module's tokenizer by fit.py.
            label_smoothing: mass spread uniformly over the vocabulary (0.1 in the paper).
            lr: peak learning rate, reached after `warmup_steps` updates.
            lr_schedule: after the warm-up, "inverse_sqrt" decays as 1/sqrt(step) (the paper's; needs no
                budget, and a run can be extended); "linear" decays to 0 when the run's budget is spent:
                trainer.max_steps, max_epochs or max_time, the first reached. Under max_time the rate
                follows the clock, so the steps of two runs do not get identical rates.
            warmup_steps: updates of linear warm-up (at least 1).
            weight_decay: decoupled (AdamW); 0 gives the paper's Adam.
            adam_betas: Adam's (beta1, beta2).
            adam_eps: Adam's epsilon.
            val_search: how the validation set is decoded for BLEU (greedy by default: beam_size 1).
            init_from: fine-tune: start from this checkpoint's weights and model config (one of ours, or
                one `python -m seq2seq.convert` wrote), with a fresh optimiser and schedule from step 0;
                `transformer` must be its config but for the dropouts and max_positions (training/pretrained.py;
                python -m seq2seq.fit fills in what the YAML leaves out).
                The data module takes the tokenizer from it (fit.py links data.init_from to it).
            compile: train through the encoder and decoder under torch.compile (training/compiled.py): true,
                false, or "auto": where the compiled step is timed to run faster here, once per machine,
                model shape and precision (the first time costs a compile, tens of seconds on a CPU; kept).
            tokens_per_update: padded positions an update sums over all devices: batches are accumulated
                (trainer.accumulate_grad_batches, then not to be given) until it is reached, with data.max_tokens
                as resolved (auto: the GPU's largest, which is then capped at this over the devices).
            fp32_residual: under bf16-mixed precision, keep the residual stream (and the norms' outputs) in float32
                as autocast alone does, rather than in bf16 (the default: Megatron-LM's choice, and fewer casts;
                model/transformer.py's Embedder; docs/results/training-speed.md#bf16-residual has what it is worth).
            rdrop_alpha: R-Drop (Liang et al. 2021) when > 0: each batch goes through the model twice with their own
                dropout masks, and the loss adds alpha / 2 times the two passes' symmetric KL divergence (training/loss.py).
                Twice the work a step; 5 is the paper's for translation. The logged train_loss is that objective per
                position trained; train_nll is both passes' NLL.
        """
        super().__init__()
        if compile not in (True, False, "auto"):
            raise ConfigError("model.compile", f"must be true, false or auto, got {compile!r}")
        if tokens_per_update is not None and (isinstance(tokens_per_update, bool) or not isinstance(tokens_per_update, int)
                                              or tokens_per_update < 1):
            raise ConfigError("model.tokens_per_update", f"must be a positive number of positions, got {tokens_per_update!r}")
        if isinstance(rdrop_alpha, bool) or not isinstance(rdrop_alpha, int | float) or not 0 <= rdrop_alpha < math.inf:
            raise ConfigError("model.rdrop_alpha", f"must be a number >= 0 (0: no R-Drop), got {rdrop_alpha!r}")
        if not isinstance(fp32_residual, bool):
            raise ConfigError("model.fp32_residual", f"must be true or false, got {fp32_residual!r}")
        check_hyperparameters(val_search=val_search, label_smoothing=label_smoothing,
                              lr=lr, lr_schedule=lr_schedule, warmup_steps=warmup_steps, weight_decay=weight_decay,
                              adam_betas=adam_betas, adam_eps=adam_eps)
        # Plain types in hparams: checkpoints must load with weights_only=True (no dataclass objects).
        pretrained = load_pretrained(init_from) if init_from is not None else None
        if pretrained is not None:
            # A whole config: every field counts as given (fit.py has merged the YAML's into init_from's)
            transformer = fine_tuning_config(pretrained.config, transformer, init_from=str(init_from),
                                             given_fields=[f.name for f in fields(TransformerConfig)])
        self.save_hyperparameters(ignore=["transformer", "val_search"])
        self.hparams["transformer"], self.hparams["val_search"] = transformer.to_dict(), asdict(val_search)
        if init_from is not None:  # absolute: a resume from another folder still names the same file
            self.hparams["init_from"] = str(Path(init_from).resolve())
        self.config, self.val_search = transformer, val_search
        self.model = Transformer(transformer)
        self.model.residual_in_fp32_under_autocast(enabled=fp32_residual)
        if pretrained is not None:
            self.model.load_state_dict(pretrained.weights)  # names and shapes checked against the same shapes
        self.tokenizer: Tokenizer | None = None  # taken from the data module in setup()
        self.target_tag = "encoder"  # setup(): the data module's (where a multilingual run's tags go)
        self._decoder_tags: list[int] | None = None
        self._validation_outputs: list[ValidationRow] = []
        # Between two logs: summed (loss, NLL) on the device, target tokens, the clock at the first step
        self._interval_sums: Tensor | None = None
        self._interval_tokens = 0
        self._interval_started: float | None = None
        self._logged_step = -1
        self._diverged_at: Tensor | None = None  # the first step with non-finite gradients (-1: none), on the device
        self._budget: int | None = None  # the batches' token budget as resolved (on_fit_start), or a resume's
        self.lr_multiplier = multiplier(lr_schedule, warmup_steps=warmup_steps)  # LambdaLR's; plain data
        self._hidden_states: HiddenStates | None = None  # the compiled encoder and decoder, where on_fit_start chose them

    # ---- wiring -------------------------------------------------------------------------------

    def setup(self, stage: str) -> None:
        datamodule = self.trainer.datamodule  # type: ignore[attr-defined]  # set by Trainer.fit, not declared
        self.tokenizer = datamodule.tokenizer
        if self.tokenizer.vocab_size != self.config.vocab_size:
            raise ValueError(
                f"the tokenizer has {self.tokenizer.vocab_size} pieces but the model was built for "
                f"{self.config.vocab_size}; delete the stale tokenizer or the checkpoint you resume from"
            )
        if self.tokenizer.pad_id != self.config.pad_id:
            raise ConfigError("model.transformer.pad_id", f"must be the tokenizer's pad id {self.tokenizer.pad_id}, "
                              f"got {self.config.pad_id}; leave it out")
        self.src_lang, self.tgt_lang = datamodule.src_lang, datamodule.tgt_lang
        # a multilingual run's (src, tgt) pairs, in the data's order (validation rows index them); () for one
        self.directions = tuple((d.src_lang, d.tgt_lang) for d in datamodule.directions or ())
        self.target_tag = getattr(datamodule, "target_tag", "encoder")
        # with the tag as the decoder's first token, validation forces each row's: by direction, its tag's id
        self._decoder_tags = ([self.tokenizer.tag_id(tgt) for _, tgt in self.directions]
                              if self.target_tag == "decoder" else None)

    def on_fit_start(self) -> None:
        """On the training device, before the first loader is built: the token budget (data.max_tokens auto: sized
        to the GPU's memory, training/budget.py; a resumed run's own), the accumulation that makes
        tokens_per_update, and whether the step is compiled (MachineTuning, a callback, chose attention's precision
        in its setup)."""
        datamodule = self.trainer.datamodule  # type: ignore[attr-defined]  # set by Trainer.fit, not declared
        world = self.trainer.world_size
        wanted = self.hparams["tokens_per_update"]
        max_tokens = getattr(datamodule, "max_tokens", CPU_MAX_TOKENS)
        if max_tokens is None:  # data.max_tokens: auto
            max_tokens = self._budget or self._size_budget(datamodule, high=wanted // world if wanted else None)
            datamodule.use_max_tokens(max_tokens)
        self._budget = max_tokens
        if wanted is not None:
            self.trainer.accumulate_grad_batches = accumulation(tokens_per_update=wanted, max_tokens=max_tokens,
                                                                world_size=world)
            rank_zero_info(f"model.tokens_per_update {wanted}: {self.trainer.accumulate_grad_batches} batch(es) of "
                           f"{max_tokens} padded positions on each of {world} device(s) an update")
        # under R-Drop the encoder and decoder run on the batch twice over: timed at that size
        passes = 2 if self.hparams.get("rdrop_alpha", 0.0) > 0 else 1
        compiled = choose_compiled_step(self.trainer, self.model, setting=self.hparams["compile"],
                                        max_tokens=passes * max_tokens)
        self._hidden_states = compile_hidden_states(self.model) if compiled else None

    def _size_budget(self, datamodule: Any, *, high: int | None) -> int:
        """data.max_tokens auto: the GPU's largest budget, sized by rank 0 and followed by all; CPU_MAX_TOKENS on a CPU."""
        device = self.trainer.strategy.root_device
        if device.type != "cuda":
            return CPU_MAX_TOKENS
        budget = None
        if self.trainer.is_global_zero:
            # A copy: the model's own parameters carry DDP's gradient hooks, which a backward on rank 0 alone
            # would fire
            probe = copy.deepcopy(self.model)
            budget = size_budget(probe, length=datamodule.max_tokens_per_sentence + 1, high=high or 2**20,
                                 dtype=autocast_dtype(str(self.trainer.precision)),
                                 rdrop_alpha=self.hparams.get("rdrop_alpha", 0.0))
            del probe
            torch.cuda.empty_cache()
        budget = int(self.trainer.strategy.broadcast(budget or 0))
        rank_zero_info(f"data.max_tokens auto: {budget} padded positions a batch, the largest whose training step "
                       f"fits {device_name(device)}'s memory (training/budget.py)")
        return budget

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.stop_if_diverged()  # no checkpoint of weights a diverged step would have made NaN
        checkpoint[BUDGET_KEY] = self._budget  # a resume trains on the same batches, whatever it would size
        # Lightning calls this last, after filling checkpoint["state_dict"] (and after callbacks such as
        # weight averaging replaced it, keeping the trained weights beside): both checksums see it whole.
        assert self.tokenizer is not None, "setup() takes the tokenizer before any checkpoint is written"
        checkpoint[CHECKPOINT_KEY] = inference_entry(
            state_dict=checkpoint["state_dict"], config=self.config, tokenizer=self.tokenizer.to_bytes(),
            src_lang=self.src_lang, tgt_lang=self.tgt_lang, directions=self.directions, target_tag=self.target_tag,
        )
        checkpoint[RNG_KEY] = gather_rng_states(self.device)
        seal_training_state(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Dropout then draws the masks an unbroken run would have drawn (with the data loader's position,
        # restored by Lightning, that makes a resumed run train as if it had never stopped).
        if RNG_KEY in checkpoint:
            restore_rng_state(checkpoint[RNG_KEY], self.device)
        self._budget = checkpoint.get(BUDGET_KEY)

    def configure_optimizers(self):
        hp = self.hparams
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=hp.lr, betas=tuple(hp.adam_betas), eps=hp.adam_eps, weight_decay=hp.weight_decay,
            # One fused kernel per tensor instead of ~10 passes: faster steps on CPU and on GPU.
            fused=self.device.type in ("cpu", "cuda"),
        )
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_multiplier)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's clipping, made to work under mixed precision with the fused AdamW.

        Lightning's MixedPrecision plugin refuses to clip for any optimizer that can unscale gradients
        itself (fused AdamW says so), because under fp16 it then leaves them scaled by the GradScaler
        and would clip the scaled values. The refusal is broader than that rule: under bf16-mixed there
        is no scaler, the gradients are the true ones, and clipping them before the fused step is exact.
        Under 16-mixed, GradScaler.unscale_() before clipping is torch's recipe for clipping with any
        optimizer; the scaler then marks the optimizer as unscaled, and its step() passes the fused
        kernel only the found-infinite flag (the step is still skipped on overflow), not the scale.
        So the fused step, the fastest valid one, stays for every precision. An optimizer that is not
        fused (on devices torch has no fused AdamW for) Lightning unscales and clips itself.
        """
        plugin = self.trainer.precision_plugin
        # What Lightning's refusal tests: the optimizer unscales inside its step (fused AdamW does).
        unscales_itself = getattr(optimizer, "_step_supports_amp_scaling", False)
        if not (isinstance(plugin, MixedPrecision) and unscales_itself):
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        if not gradient_clip_val:
            return
        if plugin.scaler is not None:
            plugin.scaler.unscale_(optimizer)
        # The base class's clipping: what Lightning does at full precision, without the refusal above.
        Precision.clip_gradients(plugin, optimizer, gradient_clip_val,
                                 GradClipAlgorithmType(gradient_clip_algorithm or "norm"))

    # ---- training -----------------------------------------------------------------------------

    def token_losses(self, batch: dict[str, Any]) -> tuple[Tensor, Tensor, Tensor]:
        """Per-token (label-smoothed loss, NLL), (B, T), zero at padding; and the non-pad mask (B, T)."""
        logits = self.model(batch["src"], batch["tgt_in"])  # (B, T, V)
        tgt_out = batch["tgt_out"]
        pad = self.config.pad_id
        loss, nll = label_smoothed_nll(logits, tgt_out, smoothing=self.hparams["label_smoothing"], pad_id=pad)
        return loss, nll, tgt_out != pad

    def configure_callbacks(self) -> list[L.Callback]:
        # Lightning asks for these before configure_optimizers: the multiplier exists from __init__.
        budget = [LinearBudget(self.lr_multiplier)] if isinstance(self.lr_multiplier, LinearToZero) else []
        return [MachineTuning(), *budget]

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self._interval_started is None:
            self._interval_started = time.perf_counter()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        loss, nll, tokens = training_loss(
            self.model, src=batch["src"], tgt_in=batch["tgt_in"], tgt_out=batch["tgt_out"],
            smoothing=self.hparams["label_smoothing"], hidden_states=self._hidden_states,
            target_positions=batch.get("target_positions"), rdrop_alpha=self.hparams.get("rdrop_alpha", 0.0),
        )
        # Summed on the device until the next log: reading a value every step (.item(), a log Lightning's
        # progress bar reads) makes the host wait for the device at every step
        sums = torch.stack([loss.detach(), nll.detach()]).float()  # (2,)
        self._interval_sums = sums if self._interval_sums is None else self._interval_sums + sums
        self._interval_tokens += tokens
        return loss / tokens  # normalised per target token

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Stop a run that diverged before the step makes its weights NaN and a checkpoint saves them.

        Here, not on the loss: the gradients are already averaged across DDP ranks, so every rank sees
        the same norm and stops together (a loss check would stop one rank and hang the others), and an
        infinite gradient under a finite loss is caught too. The fused AdamW (CPU, GPU) takes the flag as
        GradScaler hands it one, `found_inf`, and skips the step on the device; the flag is read at the next
        log, validation or checkpoint (`stop_if_diverged`), so the host never waits for it inside a step. Another
        optimizer is stopped at once (a wait per step). Not under fp16, whose loss scaler expects an occasional
        infinite gradient and skips that step itself.
        """
        if autocast_dtype(str(self.trainer.precision)) is torch.float16:
            return
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if not grads:
            return
        finite = torch.isfinite(torch.stack(torch._foreach_norm(grads)).sum())
        inner = getattr(optimizer, "_optimizer", optimizer)  # under a LightningOptimizer, torch's
        if getattr(inner, "_step_supports_amp_scaling", False):  # fused: reads found_inf after the closure
            inner.found_inf = (~finite).float()  # type: ignore[union-attr]  # GradScaler's protocol
            if self._diverged_at is None:
                self._diverged_at = torch.full((), -1, dtype=torch.long, device=finite.device)
            first = (self._diverged_at < 0) & ~finite
            self._diverged_at = torch.where(first, self.global_step, self._diverged_at)
        elif not finite:
            self._diverged_at = torch.tensor(self.global_step)
            self.stop_if_diverged()

    def stop_if_diverged(self) -> None:
        """TrainingDiverged where a step found non-finite gradients (a wait for the device)."""
        step = int(self._diverged_at) if self._diverged_at is not None else -1
        if step >= 0:
            raise TrainingDiverged(
                f"the gradients are NaN or infinite at step {step}: the run diverged (checkpoints "
                "written before are kept). Start a new run with a lower model.lr or a longer model.warmup_steps: "
                "a resume would restore the same learning rate and schedule"
            )

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # (set on the Trainer by Lightning's logger connector, not declared on it)
        step, every = self.global_step, int(self.trainer.log_every_n_steps)  # type: ignore[attr-defined]
        if every == 0 or step == 0 or step == self._logged_step or step % every != 0 or self._interval_sums is None:
            return  # (as Lightning writes its logs: when the update count reaches a multiple of log_every_n_steps)
        self.stop_if_diverged()
        elapsed = time.perf_counter() - (self._interval_started or time.perf_counter())
        loss, nll = self._interval_sums / max(self._interval_tokens, 1)
        self.log("train_loss", loss, prog_bar=True, batch_size=1)
        self.log("train_nll", nll, batch_size=1)
        # Per process, over the updates since the last log, data loading included: multiply by the number of
        # processes for the whole job.
        self.log("tgt_tokens_per_sec", self._interval_tokens / max(elapsed, 1e-9), prog_bar=True, batch_size=1)
        self._logged_step, self._interval_sums, self._interval_tokens = step, None, 0
        self._interval_started = time.perf_counter()

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
            self.stop_if_diverged()

    def on_train_end(self) -> None:
        self.stop_if_diverged()

    # ---- validation ---------------------------------------------------------------------------

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        loss, nll, is_real = self.token_losses(batch)
        indices = batch["index"].tolist() if isinstance(batch["index"], Tensor) else list(batch["index"])
        directions = batch["direction"].tolist() if "direction" in batch else [0] * len(indices)
        hypotheses = self.translate_batch(batch["src"], directions=directions)
        rows = zip(
            zip(directions, indices, strict=True), hypotheses, batch["ref_text"], loss.sum(1).tolist(), nll.sum(1).tolist(),
            is_real.sum(1).tolist(), strict=True,
        )
        self._validation_outputs.extend(rows)

    def translate_batch(self, src: Tensor, *, directions: list[int] | None = None) -> list[str]:
        """The greedy (val_search) text of each source; `directions`: each row's (a multilingual run's, whose
        decoder-side tags are forced as the first token; decoding drops them from the text)."""
        assert self.tokenizer is not None
        tokenizer = self.tokenizer
        # Validation reads the text alone: without scores greedy search skips the normaliser (the same tokens)
        search = replace(self.val_search, scores=False)
        tags = self._decoder_tags
        prefix = [[tags[k]] for k in directions or [0] * src.size(0)] if tags is not None else None
        nbest = decode(self.model, src, search, bos=tokenizer.bos_id, eos=tokenizer.eos_id, pad=tokenizer.pad_id,
                       prefix=prefix)
        return self.tokenizer.decode([hyps[0].tokens for hyps in nbest])

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
        # Per direction (one for a bilingual run): BLEU and chrF of its sentences; the run's are their means, so
        # that best.ckpt and the length penalty serve every direction, not the largest
        scores = {k: self._scores([row for row in rows if row[0][0] == k]) for k in sorted({row[0][0] for row in rows})}
        bleu = sum(bleu_score.score for bleu_score, _, _ in scores.values()) / len(scores)
        chrf = sum(chrf_score.score for _, chrf_score, _ in scores.values()) / len(scores)
        # Every rank computed the same numbers from the same gathered rows; sync_dist averages equal values
        # (a few scalars per validation) and keeps Lightning from warning about unsynced epoch metrics.
        metrics = {
            "val_loss": sum(losses) / tokens,
            "val_nll": sum(nlls) / tokens,
            "val_ppl": math.exp(min(sum(nlls) / tokens, 50.0)),
            "val_bleu": bleu,
            "val_chrf": chrf,
            "val_sentences": float(len(rows)),
        }
        for k, (bleu_score, _, _) in scores.items() if self.directions else ():
            metrics[f"val_bleu/{'-'.join(self.directions[k])}"] = bleu_score.score
        for name, value in metrics.items():
            self.log(name, value, prog_bar=name == "val_bleu", sync_dist=True)
        signature = next(iter(scores.values()))[2]
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            mean = " (the directions' mean)" if self.directions else ""
            self.print(
                f"epoch {self.current_epoch} step {self.global_step}: val BLEU {bleu:.2f} "
                f"chrF {chrf:.2f}{mean} ppl {metrics['val_ppl']:.2f} "
                f"on {len(rows)} sentences  [{signature}]"
            )
            for k, (bleu_score, chrf_score, _) in scores.items() if self.directions else ():
                self.print(f"  {'-'.join(self.directions[k])}: BLEU {bleu_score.score:.2f} chrF {chrf_score.score:.2f}")
            self.print(f"  e.g. {hypotheses[0]!r}\n   ref {references[0]!r}")

    @staticmethod
    def _scores(rows: list[ValidationRow]) -> tuple[Any, Any, str]:
        """sacreBLEU's corpus BLEU and chrF of `rows`' hypotheses against their references, and BLEU's signature."""
        hypotheses, references = [row[1] for row in rows], [row[2] for row in rows]
        bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
        scores = bleu.corpus_score(hypotheses, [references]), chrf.corpus_score(hypotheses, [references])
        return (*scores, str(bleu.get_signature()))
