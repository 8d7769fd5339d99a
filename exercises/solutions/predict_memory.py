"""Reference solution of exercises/predict_memory.py (lesson 21)."""

import math

from torch import nn


def bytes_per_rank(units: list[nn.Module], world_size: int, stage: int) -> dict[str, int]:
    N = world_size
    numels = [sum(p.numel() for p in u.parameters()) for u in units]
    P = sum(numels)  # parameters
    shard = sum(math.ceil(n / N) for n in numels)  # this rank's elements, over all units
    if stage == 0:  # DDP: everything whole; Adam's step counter per parameter tensor
        tensors = sum(len(list(u.parameters())) for u in units)
        return {"parameters": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P + 4 * tensors}
    return {
        "parameters": 4
        * (shard if stage == 3 else N * shard),  # stages 1-2: the padded flat buffers
        "gradients": 4 * (P if stage == 1 else shard),  # stage 1 shards only the optimizer state
        "optimizer_state": 8 * shard + 4 * len(numels),
    }  # Adam over one shard per unit
