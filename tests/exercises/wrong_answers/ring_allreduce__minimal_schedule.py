"""Wrong: the reduce-scatter copied from lesson 02's minimal script (rank r sends chunk (r - s) mod n at step
s), then chunk r returned: that schedule completes chunk (r + 1) mod n on rank r, and chunk r is partial."""

import torch
import torch.distributed as dist

from exercises.solutions.ring_allreduce import _exchange, ring_all_reduce  # noqa: F401


def ring_reduce_scatter(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor.clone(), n)
    for step in range(n - 1):
        send, recv = (
            chunks[(rank - step) % n],
            chunks[(rank - step - 1) % n],
        )  # the minimal script's
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, (rank + 1) % n, (rank - 1) % n)
        recv += incoming
    return chunks[rank].clone()  # the bug: rank r completed chunk r + 1
