"""Wrong: under ZeRO, Adam's 4-byte `step` counted once per model parameter, as under DDP; Adam updates each
unit's shard, one tensor per unit, so it keeps one step per unit."""

import math


def bytes_per_rank(units, world_size, stage):
    N = world_size
    numels = [sum(p.numel() for p in u.parameters()) for u in units]
    P, shard = sum(numels), sum(math.ceil(n / N) for n in numels)
    tensors = sum(len(list(u.parameters())) for u in units)
    if stage == 0:
        return {"parameters": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P + 4 * tensors}
    return {
        "parameters": 4 * (shard if stage == 3 else N * shard),
        "gradients": 4 * (P if stage == 1 else shard),
        "optimizer_state": 8 * shard + 4 * tensors,
    }  # the bug: a step per parameter
