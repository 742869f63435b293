"""Training: the only package that imports Lightning. The LightningModule (module.py), its learning-rate
schedules (schedule.py), resumed random state (resume.py) and machine tuning (machine.py), the data module (data.py), the callbacks
the configs name (callbacks.py) and the LightningCLI behind `python -m seq2seq.fit` (fit.py). Nothing
here imports inference: the length penalty is tuned by seq2seq/inference/tune.py, which the face runs after fit."""
