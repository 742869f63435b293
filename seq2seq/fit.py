"""python -m seq2seq.fit --config configs/demo.yaml [--key value ...]: train a model (the face; the
LightningCLI and its checks are seq2seq/training/fit.py)."""

from seq2seq.training.fit import main

if __name__ == "__main__":
    main()
