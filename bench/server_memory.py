"""What N models behind one server cost in memory: the server (serve/server.py's app, in this process)
with 1, 2, ... N copies of one checkpoint, each given a pair of its own, after each has translated a
batch of Multi30k test sentences; the resident memory (RSS) per step, its growth per model (noisy: the
allocator reuses what loading one model freed for the next), and each model's weights.

    python bench/server_memory.py --checkpoint checkpoints/multi30k-ende/best.ckpt [--models 3]

Run by hand, not in CI.
"""

import argparse
import gzip
from pathlib import Path

from decode_vs_ct2 import cpu_model
from language_id import rss_mib
from starlette.testclient import TestClient

REPO = Path(__file__).resolve().parents[1]
from seq2seq.inference.translator import Translator  # noqa: E402
from seq2seq.serve.app import create_app  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--models", type=int, default=3)
    parser.add_argument("--data", default=str(REPO.parent / "shared/data/multi30k"))
    args = parser.parse_args()
    base = Translator.from_checkpoint(args.checkpoint)
    with gzip.open(Path(args.data) / f"test_2016_flickr.{base.src_lang}.gz", "rt", encoding="utf-8") as f:
        sentences = [line.strip() for line in f if line.strip()][:64]
    print(f"{cpu_model()}; {args.checkpoint} ({base.precision}), 64 sentences translated per model")
    print("| models | RSS | growth | the new model's weights |")
    print("|---|---|---|---|")
    del base
    previous = rss_mib()
    print(f"| 0 (torch, the code) | {previous:.0f} MiB | |")
    translators = []
    for k in range(1, args.models + 1):
        loaded = Translator.from_checkpoint(args.checkpoint)
        loaded.tgt_lang = f"{loaded.tgt_lang}{k}"  # a pair of its own
        translators.append(loaded)
        with TestClient(create_app(translators)) as client:
            for t in translators:
                reply = client.post("/translate", json={"q": sentences, "source": t.src_lang, "target": t.tgt_lang})
                assert reply.status_code == 200, reply.text
            now = rss_mib()
        weights = sum(t.numel() * t.element_size() for t in loaded.model.state_dict().values()) / 2**20
        print(f"| {k} | {now:.0f} MiB | +{now - previous:.0f} MiB | {weights:.0f} MiB |", flush=True)
        previous = now


if __name__ == "__main__":
    main()
