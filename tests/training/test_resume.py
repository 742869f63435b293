"""Tests for seq2seq.training.resume: the random state a resume restores. (A run killed and resumed
training exactly as one that never stopped: tests/training/test_fit.py.)"""

import torch

from seq2seq.training.resume import gather_rng_states, restore_rng_state


def test_rng_states_of_a_cuda_device_are_saved_and_restored(monkeypatch):
    """The CUDA branch of the resume's random state, with torch.cuda's calls standing in (no GPU here)."""
    saved, restored = torch.tensor([1, 2, 3], dtype=torch.uint8), []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device=None: saved)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device=None: restored.append((state, device)))
    cuda = torch.device("cuda", 0)
    states = gather_rng_states(cuda)
    assert states["cuda"] == [saved] and len(states["cpu"]) == 1
    restore_rng_state(states, cuda)
    assert restored == [(saved, cuda)]
    restore_rng_state({"cpu": states["cpu"]}, cuda)  # a checkpoint written on a CPU: the GPU keeps its state
    assert len(restored) == 1
