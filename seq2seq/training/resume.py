"""What a resumed run needs besides what Lightning restores: every rank's random-number state, so that
dropout draws the masks an unbroken run would have drawn. (The data loader's place in its epoch is
training/data.py's ResumableLoader.)"""

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

RNG_KEY = "rng_states"  # per rank: {"cpu": [ByteTensor], "cuda": [ByteTensor]}


def gather_rng_states(device: torch.device) -> dict[str, list[Tensor]]:
    """torch's random-number state of every rank (Lightning builds a checkpoint on all ranks, rank 0 writes it)."""
    states = {"cpu": [torch.get_rng_state()]}
    if device.type == "cuda":
        states["cuda"] = [torch.cuda.get_rng_state(device)]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[dict[str, list[Tensor]]] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(gathered, states)
        states = {kind: [part[kind][0] for part in gathered] for kind in states}
    return states


def restore_rng_state(states: dict[str, list[Tensor]], device: torch.device) -> None:
    distributed = dist.is_available() and dist.is_initialized()
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if len(states["cpu"]) != world_size:  # every rank compares; rank 0 says it
        rank_zero_warn(f"the checkpoint holds the random state of {len(states['cpu'])} processes, this run has "
                       f"{world_size}: dropout masks will differ from the first run's (training goes on)")
        return
    torch.set_rng_state(states["cpu"][rank])
    if device.type == "cuda" and "cuda" in states:
        torch.cuda.set_rng_state(states["cuda"][rank], device)
