"""Decoding: SearchConfig and the model protocols, beam search, greedy and sampling (search.py), constrained
decoding (constraints.py) and teacher-forced scoring (scoring.py). It knows the model only through `encode` and a
one-step `decode`."""
