"""What a user waits for: our translate command as the README shows it, as a whole process (start, imports, loading
and checking the checkpoint, translating, writing), against CTranslate2 at its best doing the same work.

    python bench/whole_command.py --checkpoint checkpoints/multi30k/best.ckpt [--lines 1000] [--beams 5 1]

Ours: `python -m seq2seq.translate --checkpoint X --input in --output out --beam B` with no speed flag (the
defaults: `auto` precision, workers and threads, the compiled decoder kept for the model on this machine where
`python -m seq2seq.export --to compiled` built it, else eager; `--ours-flags` names the variants timed, by default
that and `--compile off`). CTranslate2: a short script as its documentation writes one (load the export, sentencepiece in and
out, `translate_batch`, write), over the same checkpoint exported to int8 and float32, in every configuration of
the cores (`inter_threads` x `intra_threads`) and batch (`max_batch_size` in examples and in tokens); its fastest
counts. Both search with the same beam, at most the same number of output tokens, PAD and BOS never generated.
Their length normalisations differ (ours GNMT's alpha from the checkpoint, CTranslate2's `length_penalty` its own),
so beam 5's outputs are not token for token the same work; greedy is.

The sweep runs each CTranslate2 configuration once; then ours and CTranslate2's fastest take turns `--repeats`
times, and each one's fastest run counts, so a burst of load hits both alike. Prints the machine (lscpu), torch's and
CTranslate2's versions, the commit, every configuration's wall time, and the ratio. Run by hand, not in CI.
"""

import argparse
import gzip
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from seq2seq.checkpoint import load_checkpoint, read_inference
from seq2seq.interop.export import export_ctranslate2

REPO = Path(__file__).resolve().parents[1]

# The CTranslate2 user's script: what its documentation's quickstart does, with the file in and out.
THEIRS = '''
import sys, ctranslate2, sentencepiece as spm
folder, source, output, beam, max_len, inter, intra, batch, batch_type, compute = sys.argv[1:11]
sp = spm.SentencePieceProcessor(model_file=folder + "/source.spm")
translator = ctranslate2.Translator(folder, device="cpu", compute_type=compute, inter_threads=int(inter),
                                    intra_threads=int(intra))
with open(source, encoding="utf-8") as lines:
    texts = [line.rstrip("\\n") for line in lines]
results = translator.translate_batch(sp.encode(texts, out_type=str), beam_size=int(beam),
                                     max_decoding_length=int(max_len), max_batch_size=int(batch),
                                     batch_type=batch_type, suppress_sequences=[["<pad>"], ["<s>"]])
with open(output, "w", encoding="utf-8") as out:
    out.writelines(sp.decode(result.hypotheses[0]) + "\\n" for result in results)
'''


def lscpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    model = fields.get("Model name", "unknown CPU").strip()
    return f"{model}, family {fields.get('CPU family', '?').strip()} model {fields.get('Model', '?').strip()}"


def commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def timed(command: list[str], *, env: dict[str, str]) -> float:
    """Seconds of the whole process, from the fork to its exit; a failure is an error, not a fast run."""
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} exited {result.returncode}:\n{result.stderr[-2000:]}")
    return seconds


def configurations(cores: int) -> list[tuple[int, int, int, str]]:
    """CTranslate2's (inter, intra, max_batch_size, batch_type) that use `cores` cores."""
    splits = sorted({(inter, cores // inter) for inter in range(1, cores + 1) if cores % inter == 0})
    batches = [(16, "examples"), (32, "examples"), (64, "examples"), (1024, "tokens"), (2048, "tokens"),
               (4096, "tokens"), (8192, "tokens")]
    return [(inter, intra, size, kind) for inter, intra in splits for size, kind in batches]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint of python -m seq2seq.fit")
    parser.add_argument("--data", default=str(REPO.parent / "shared/data/multi30k"))
    parser.add_argument("--lines", type=int, default=1000, help="test2016 lines, in the checkpoint's source language")
    parser.add_argument("--beams", type=int, nargs="+", default=[5, 1])
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ours-flags", nargs="+", default=["", "--compile off"],
                        help="our command's variants, each timed in turn with CTranslate2's best: the flags added to it "
                             "(default: none, as a user runs it, and --compile off, the eager decoder)")
    parser.add_argument("--compute-types", nargs="+", default=["int8", "float32"])
    args = parser.parse_args()

    import ctranslate2

    inference = read_inference(args.checkpoint, load_checkpoint(args.checkpoint))
    max_len = inference.config.max_positions - 1  # our limit is a x source + b, at most this; theirs a constant
    with gzip.open(Path(args.data) / f"test_2016_flickr.{inference.src_lang}.gz", "rt", encoding="utf-8") as file:
        lines = [line.rstrip("\n") for line in file][: args.lines]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    print(f"{lscpu_model()}, {args.cores} cores; torch {torch.__version__}, ctranslate2 {ctranslate2.__version__}; "
          f"commit {commit()}; {len(lines)} lines of test2016 {inference.src_lang}->{inference.tgt_lang}")
    with tempfile.TemporaryDirectory() as scratch_name:
        scratch = Path(scratch_name)
        source = scratch / "source.txt"
        source.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        script = scratch / "theirs.py"
        script.write_text(THEIRS, encoding="utf-8")
        folders = {compute: export_ctranslate2(args.checkpoint, scratch / compute,
                                               quantization=None if compute == "float32" else compute)
                   for compute in args.compute_types}
        for beam in args.beams:
            ours = {flags: [sys.executable, "-m", "seq2seq.translate", "--checkpoint", args.checkpoint, "--input",
                            str(source), "--output", str(scratch / "ours.txt"), "--force", "--beam", str(beam),
                            *flags.split()] for flags in args.ours_flags}

            def theirs(compute: str, inter: int, intra: int, size: int, kind: str, beam: int = beam) -> list[str]:
                return [sys.executable, str(script), str(folders[compute]), str(source), str(scratch / "theirs.txt"),
                        str(beam), str(max_len), str(inter), str(intra), str(size), kind, compute]

            print(f"\nbeam {beam}: CTranslate2's configurations, one run each (seconds, whole process)")
            sweep = {}
            for compute in folders:
                for config in configurations(args.cores):
                    sweep[(compute, *config)] = timed(theirs(compute, *config), env=env)
                    print(f"  {compute:8} inter {config[0]} x intra {config[1]}, max_batch_size {config[2]} "
                          f"{config[3]}: {sweep[(compute, *config)]:.2f}")
            best = min(sweep, key=sweep.__getitem__)
            times: dict[str, list[float]] = {flags: [] for flags in [*ours, "theirs"]}
            for _ in range(args.repeats):  # in turns
                for flags, command in ours.items():
                    times[flags].append(timed(command, env=env))
                times["theirs"].append(timed(theirs(*best), env=env))
            their = min(times["theirs"])
            print(f"beam {beam}: CTranslate2 at its best ({best[0]}, inter {best[1]} x intra {best[2]}, max_batch_size "
                  f"{best[3]} {best[4]}) {their:.2f} s (runs: {', '.join(f'{t:.2f}' for t in times['theirs'])})")
            for flags in ours:
                mine = min(times[flags])
                print(f"beam {beam}: ours `python -m seq2seq.translate ... --beam {beam}{' ' + flags if flags else ''}` "
                      f"{mine:.2f} s (runs: {', '.join(f'{t:.2f}' for t in times[flags])}); ours / theirs by speed: "
                      f"{their / mine:.2f}x")

if __name__ == "__main__":
    main()
