"""Wrong: ZeRO-1 counted as if it sharded the gradients too (it shards only the optimizer state; backward
still leaves every gradient on every rank until the step)."""

import math


def bytes_per_rank(units, world_size, stage):
    N = world_size
    numels = [sum(p.numel() for p in u.parameters()) for u in units]
    P, shard = sum(numels), sum(math.ceil(n / N) for n in numels)
    if stage == 0:
        tensors = sum(len(list(u.parameters())) for u in units)
        return {"parameters": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P + 4 * tensors}
    return {
        "parameters": 4 * (shard if stage == 3 else N * shard),
        "gradients": 4 * shard,
        "optimizer_state": 8 * shard + 4 * len(numels),
    }
