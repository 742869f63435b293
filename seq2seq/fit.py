"""python -m seq2seq.fit --config configs/X.yaml [--trainer.max_epochs=3 ...] [--ckpt_path last]

LightningCLI over TranslationModule and TranslationDataModule: the YAML's `trainer:`, `model:` and
`data:` sections are their constructor arguments. The model's vocabulary size is linked from the
data module's tokenizer (trained on the first run, by one process only), so no number has to be
kept in sync by hand.
"""

from lightning.pytorch.cli import LightningCLI

from seq2seq.data import TranslationDataModule
from seq2seq.module import TranslationModule


class TranslationCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.add_argument(
            "--ckpt_path",
            type=str | None,
            default=None,
            help="resume from this checkpoint: a path, or 'last' for the newest one the checkpoint callback wrote",
        )
        # The data module's batch sampler shards token-budget batches across ranks itself; Lightning's
        # DistributedSampler would split them a second time.
        parser.set_defaults({"trainer.use_distributed_sampler": False})


def main(args: list[str] | None = None) -> TranslationCLI:
    cli = TranslationCLI(
        TranslationModule,
        TranslationDataModule,
        run=False,
        # A second run in the same folder overwrites the saved config instead of refusing to start.
        save_config_kwargs={"overwrite": True},
        args=args,
    )
    cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=cli.config.get("ckpt_path"))
    checkpoint = cli.trainer.checkpoint_callback
    if cli.trainer.is_global_zero and checkpoint is not None:
        best = checkpoint.best_model_score
        print(
            f"best {checkpoint.monitor} = {best.item() if best is not None else float('nan'):.2f}: "
            f"{checkpoint.best_model_path or '(none)'}; last: {checkpoint.last_model_path or '(none)'}"
        )
    return cli


if __name__ == "__main__":
    main()
