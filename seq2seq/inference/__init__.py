"""Inference: the Translator (translator.py) and the length penalty tuned on validation (tune.py)."""
