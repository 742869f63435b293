"""Training: the only package that imports Lightning. The LightningModule (module.py), the data module
(data.py), the callbacks the configs name (callbacks.py) and the LightningCLI behind `python -m
seq2seq.fit` (fit.py). Nothing here imports the translator, but TuneLengthPenalty (callbacks.py)."""
