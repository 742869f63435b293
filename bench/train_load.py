"""Training throughput beside a fixed CPU load: how much each thread / OpenMP / process setting loses.

    python bench/train_load.py [--seconds 20] [--configs 2t 2t-passive 1t 2x1t] [--loads none busy1 torch2]

Measures target tokens per second of training steps of our Transformer at the "multi30k" size
(d_model 256, 3+3 layers, 8k vocabulary; forward, fused loss, backward, fused AdamW, as
bench/train_throughput.py builds it) on Multi30k batches of ~2048 padded tokens (configs/multi30k.yaml),
first unloaded and then, back to back, beside each load:

    busy1   one 1-core busy Python loop (`while True: pass`)
    torch2  a 2-thread torch job: 512x512 fp32 matmuls in a loop, torch.set_num_threads(2),
            default OpenMP settings (like another training job)

and prints loaded / unloaded per configuration. With 2 cores, a load that wants one core (busy1)
or as many threads as there are cores (torch2) leaves a fair share of ~0.5x; much less than that
means the configuration loses more than the cores taken.

Every configuration runs in fresh subprocesses (OMP_WAIT_POLICY, GOMP_SPINCOUNT and OMP_NUM_THREADS
only act when set before torch, and so libgomp, loads). A worker warms up (2 steps), says "ready",
waits for "go" on stdin, then trains for --seconds and reports tokens, wall time, CPU time and
context switches as one JSON line. "2x1t" runs two independent 1-thread workers at once and adds
their tokens/s: what DDP with 2 processes x 1 thread does on CPU, minus its per-step gradient
all-reduce (so an upper bound for DDP). The load processes are started before the workers and killed
after them. /proc/loadavg is printed before each measurement (other people's jobs show up there).
Run by hand, not in CI; takes about configs x loads x (seconds + ~10 s).
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZE = "multi30k"
MAX_TOKENS = 2048  # configs/multi30k.yaml: data.max_tokens


@dataclass(frozen=True)
class Config:
    """One way to train: how many processes, threads each, and extra environment for them."""

    name: str
    processes: int
    threads: int
    env: dict[str, str] = field(default_factory=dict)


CONFIGS = {
    c.name: c
    for c in [
        Config("2t", 1, 2),  # libgomp's default: spin (300k iterations) before sleeping
        Config("2t-passive", 1, 2, {"OMP_WAIT_POLICY": "PASSIVE"}),
        Config("2t-spin10k", 1, 2, {"GOMP_SPINCOUNT": "10000"}),  # what `python -m seq2seq.fit` sets
        Config("2t-spin100k", 1, 2, {"GOMP_SPINCOUNT": "100000"}),
        Config("1t", 1, 1),
        Config("2x1t", 2, 1),  # like DDP 2 processes x 1 thread, without the all-reduce
    ]
}

LOADS = {
    "none": None,
    "busy1": "while True: pass",
    "torch2": (
        "import torch\n"
        "torch.set_num_threads(2)\n"
        "a, b = torch.randn(512, 512), torch.randn(512, 512)\n"
        "while True: a @ b\n"
    ),
}


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


TICK = os.sysconf("SC_CLK_TCK")


def machine_busy_s() -> float:
    """CPU seconds all cores spent busy since boot (user..softirq, not idle / iowait / steal)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / TICK


def process_cpu_s(pid: int) -> float:
    """CPU seconds of a process, all its threads (utime + stime from /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# ---------------------------------------------------------------- worker (one training process)


def worker(batches_path: Path, threads: int, seconds: float) -> None:
    import torch  # only here: the parent set OMP_* in our environment before this import
    from train_throughput import SIZES, make_step, ours, ours_loss

    from seq2seq.text.tokenizer import PAD_ID

    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)  # as training does (seq2seq/training/module.py)
    batches: list[dict] = torch.load(batches_path)
    d_model, heads, d_ff, layers, vocab, placement, _ = SIZES[SIZE]
    torch.manual_seed(0)
    model = ours(d_model=d_model, num_heads=heads, d_ff=d_ff, layers=layers, vocab=vocab, norm_placement=placement)
    step = make_step(model.train(), ours_loss, bf16=False)
    for batch in batches[:2]:  # warm-up
        step(batch)
    print("ready", flush=True)
    sys.stdin.readline()  # "go": all workers of a configuration start together

    usage0, cpu0, start = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.perf_counter()
    tokens = steps = 0
    while time.perf_counter() - start < seconds:
        batch = batches[steps % len(batches)]
        step(batch)
        tokens += int((batch["tgt_out"] != PAD_ID).sum())
        steps += 1
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu0
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({
        "tokens": tokens, "steps": steps, "wall": wall, "cpu": cpu,
        "voluntary_switches": usage.ru_nvcsw - usage0.ru_nvcsw,
        "involuntary_switches": usage.ru_nivcsw - usage0.ru_nivcsw,
    }), flush=True)


# ---------------------------------------------------------------- parent (starts loads and workers)


@dataclass
class Result:
    tokens_per_s: float  # summed over the configuration's processes
    cpu_per_wall: float  # CPU seconds per wall second, summed over processes (2.0 = both cores busy)
    steps: int
    switches: int  # voluntary + involuntary context switches per step, all processes
    load_cores: float = 0.0  # CPU seconds per wall second of the load process
    foreign_cores: float = 0.0  # the same for everything else on the machine (other people's jobs)


def measure(config: Config, batches_path: Path, seconds: float, load: subprocess.Popen | None) -> Result:
    env = {**os.environ, "OMP_NUM_THREADS": str(config.threads), **config.env}
    command = [sys.executable, __file__, "--worker", str(batches_path), "--threads", str(config.threads),
               "--seconds", str(seconds)]
    workers = [subprocess.Popen(command, env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for _ in range(config.processes)]
    for w in workers:
        assert w.stdout.readline().strip() == "ready", "worker failed to start"
    busy0, load0, start = machine_busy_s(), load and process_cpu_s(load.pid), time.perf_counter()
    for w in workers:
        w.stdin.write("go\n")
        w.stdin.flush()
    reports = []
    for w in workers:
        reports.append(json.loads(w.stdout.readline()))
    busy, load_cpu, wall = machine_busy_s() - busy0, load and process_cpu_s(load.pid) - load0, time.perf_counter() - start
    for w in workers:
        w.communicate(timeout=60)
        if w.returncode:
            raise RuntimeError(f"worker exited with {w.returncode}")
    steps = sum(r["steps"] for r in reports)
    ours = sum(r["cpu"] for r in reports)
    return Result(
        tokens_per_s=sum(r["tokens"] / r["wall"] for r in reports),
        cpu_per_wall=sum(r["cpu"] / r["wall"] for r in reports),
        steps=steps,
        switches=round(sum(r["voluntary_switches"] + r["involuntary_switches"] for r in reports) / max(steps, 1)),
        load_cores=(load_cpu or 0) / wall,
        foreign_cores=max(busy - ours - (load_cpu or 0), 0) / wall,
    )


def start_load(name: str) -> subprocess.Popen | None:
    code = LOADS[name]
    if code is None:
        return None
    load = subprocess.Popen([sys.executable, "-c", code], cwd=REPO)
    time.sleep(2)  # torch import and thread start-up of the load
    return load


def stop(load: subprocess.Popen | None) -> None:
    if load is not None:
        load.kill()
        load.wait()


def prepare_batches(workdir: Path, count: int) -> Path:
    import torch
    from train_throughput import batches_for

    batches = batches_for(vocab_tokens=8000, max_tokens=MAX_TOKENS, count=count, workdir=workdir)
    path = workdir / "batches.pt"
    torch.save(batches, path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[2:]))
    parser.add_argument("--seconds", type=float, default=20.0, help="timed training per measurement (after warm-up)")
    parser.add_argument("--configs", nargs="+", default=["2t", "2t-passive", "2t-spin10k", "1t", "2x1t"],
                        choices=list(CONFIGS))
    parser.add_argument("--loads", nargs="+", default=["none", "busy1", "torch2"], choices=list(LOADS),
                        help="'none' (unloaded) is always measured first")
    parser.add_argument("--batches", type=int, default=30, help="distinct batches, cycled through")
    parser.add_argument("--workdir", type=Path, default=None, help="tokenizer, cache and batches (default: a temp dir)")
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.threads, args.seconds)
        return

    loads = ["none"] + [load for load in args.loads if load != "none"]
    print(f"{os.cpu_count()} CPUs, affinity {sorted(os.sched_getaffinity(0))}; {args.seconds:g} s per measurement")
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        batches_path = prepare_batches(workdir, args.batches)
        rows: list[tuple[str, str, Result]] = []
        for name in args.configs:
            for load_name in loads:  # back to back: unloaded, then each load
                print(f"loadavg {loadavg()} before {name} / {load_name}", flush=True)
                load = start_load(load_name)
                try:
                    result = measure(CONFIGS[name], batches_path, args.seconds, load)
                finally:
                    stop(load)
                rows.append((name, load_name, result))
                print(f"  {name:<11} {load_name:<7} {result.tokens_per_s:8,.0f} tok/s  "
                      f"cpu/wall {result.cpu_per_wall:.2f}  {result.steps} steps  {result.switches} ctx sw/step  "
                      f"load {result.load_cores:.2f} cores  others {result.foreign_cores:.2f} cores",
                      flush=True)

    unloaded = {name: r.tokens_per_s for name, load, r in rows if load == "none"}
    header = f"\n{'config':<11} {'unloaded tok/s':>14}"
    for load in loads[1:]:
        header += f" {load + ' tok/s':>13} {'ratio':>6} {'cpu/wall':>8}"
    print(header)
    for name in args.configs:
        line = f"{name:<11} {unloaded[name]:>14,.0f}"
        for load in loads[1:]:
            r = next(r for n, kind, r in rows if n == name and kind == load)
            line += f" {r.tokens_per_s:>13,.0f} {r.tokens_per_s / unloaded[name]:>5.2f}x {r.cpu_per_wall:>8.2f}"
        print(line)
    print("cpu/wall: CPU seconds of the training process(es) per wall second; fair share beside either load ~0.5x")
    busiest = max(r.foreign_cores for _, _, r in rows)
    if busiest > 0.1:
        print(f"warning: other programs used up to {busiest:.2f} cores during a measurement (see 'others' above)")


if __name__ == "__main__":
    main()
