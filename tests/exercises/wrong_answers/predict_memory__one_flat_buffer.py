"""Wrong: the whole model padded as ONE flat buffer, N x ceil(P / N), instead of each unit on its own,
sum of N x ceil(n / N): equal whenever every unit happens to divide by N, short by up to N - 1 elements per
unit otherwise."""

import math


def bytes_per_rank(units, world_size, stage):
    N = world_size
    numels = [sum(p.numel() for p in u.parameters()) for u in units]
    P = sum(numels)
    shard = math.ceil(P / N)  # the bug: one buffer for the model
    if stage == 0:
        tensors = sum(len(list(u.parameters())) for u in units)
        return {"parameters": 4 * P, "gradients": 4 * P, "optimizer_state": 8 * P + 4 * tensors}
    return {
        "parameters": 4 * (shard if stage == 3 else N * shard),
        "gradients": 4 * (P if stage == 1 else shard),
        "optimizer_state": 8 * shard + 4 * len(numels),
    }
