"""The documentation's figures, made from the results' data so that none is drawn by hand:

    python docs/figures.py            # docs/img/*.png from docs/results/data/

- docs/img/multi30k-curves.png: a Multi30k run's learning curves from the `metrics.csv` Lightning wrote
  (docs/results/data/multi30k-metrics.csv), beside the greedy validation BLEU by epoch of the runs on the results
  page (docs/results/data/multi30k-val-bleu.csv); machines, commits and commands: docs/results/multi30k.md#curves;
- docs/img/decode-speed.png: the decode-speed table as a bar chart (docs/results/data/decode-speed.csv, each row
  with its machine and commit; docs/results/decoding-vs-ctranslate2.md).

matplotlib is in the `docs` extra (`pip install -e '.[docs]'`)."""

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)

DOCS = Path(__file__).resolve().parent
DATA = DOCS / "results" / "data"
IMG = DOCS / "img"


def read_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def series(rows: list[dict[str, str]], column: str) -> tuple[list[int], list[float]]:
    """(steps, values) of one column of a Lightning metrics.csv, where each row holds the columns logged at once."""
    points = [(int(row["step"]), float(row[column])) for row in rows if row.get(column)]
    return [step for step, _ in points], [value for _, value in points]


def learning_curves(metrics: Path, epochs: Path, out: Path) -> None:
    """Left, the loss of the run whose metrics.csv this is, by update; right, greedy validation BLEU by epoch, for
    that run and the runs of epochs (a CSV: run, commit, date, epoch, val_bleu_greedy)."""
    rows = read_rows(metrics)
    figure, (loss_axes, bleu_axes) = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
    steps, loss = series(rows, "train_loss")
    loss_axes.plot(steps, loss, color="tab:blue", label="training loss (label-smoothed)")
    val_steps, val_loss = series(rows, "val_loss")
    loss_axes.plot(val_steps, val_loss, "o-", color="tab:orange", label="validation loss")
    loss_axes.set(xlabel="update", ylabel="loss", title="Loss (the metrics.csv run)")
    loss_axes.legend()
    by_run: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in read_rows(epochs):
        by_run[f"{row['run']} ({row['commit']})"].append((int(row["epoch"]), float(row["val_bleu_greedy"])))
    by_run["the metrics.csv run"] = [(int(row["epoch"]), float(row["val_bleu"])) for row in rows if row.get("val_bleu")]
    for run, points in by_run.items():
        bleu_axes.plot([epoch for epoch, _ in points], [bleu for _, bleu in points], "o-", markersize=3, label=run)
    bleu_axes.set(xlabel="epoch", ylabel="sacreBLEU", title="Greedy validation BLEU")
    bleu_axes.legend(fontsize=8)
    for axes in (loss_axes, bleu_axes):
        axes.grid(alpha=0.3)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def decode_speed(table: Path, out: Path) -> None:
    """One group of bars a machine and search: CTranslate2's and ours, ours labelled with its precision."""
    rows = read_rows(table)
    groups: dict[str, dict[str, tuple[float, str]]] = defaultdict(dict)
    for row in rows:
        groups[f"{row['machine']}\n{row['search']}"][row["engine"]] = (float(row["tgt_tokens_per_s"]),
                                                                      row["precision"])
    engines = sorted({engine for bars in groups.values() for engine in bars})
    figure, axes = plt.subplots(figsize=(10, 0.6 + 0.9 * len(groups)), layout="constrained")
    height = 0.8 / max(len(engines), 1)
    for index, engine in enumerate(engines):
        positions = [number + index * height for number in range(len(groups))]
        cells = [bars.get(engine, (0.0, "")) for bars in groups.values()]
        bars = axes.barh(positions, [value for value, _ in cells], height=height, label=engine)
        axes.bar_label(bars, labels=[f"{value:,.0f} ({precision})" if value else "" for value, precision in cells],
                       padding=3, fontsize=8)
    axes.set_yticks([number + height * (len(engines) - 1) / 2 for number in range(len(groups))], list(groups))
    axes.invert_yaxis()
    axes.set_xlim(right=axes.get_xlim()[1] * 1.15)  # room for the labels
    axes.set(xlabel="target tokens per second (more is better)",
             title="Decoding Multi30k test2016 on 2 CPU cores, each engine at its fastest (compiling not counted)")
    axes.legend(loc="lower right", fontsize=8)
    axes.grid(axis="x", alpha=0.3)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python docs/figures.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the results' data (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=IMG, help="where the PNGs go (default: %(default)s)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    learning_curves(args.data / "multi30k-metrics.csv", args.data / "multi30k-val-bleu.csv",
                    args.out / "multi30k-curves.png")
    decode_speed(args.data / "decode-speed.csv", args.out / "decode-speed.png")


if __name__ == "__main__":
    main()
