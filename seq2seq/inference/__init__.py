"""Inference: the Translator (translator.py) over a model prepared for the machine (preparation.py), its decoder
threads (pool.py), texts prepared once (inputs.py), translations and documents (documents.py), and the length
penalty tuned on validation (tune.py)."""
