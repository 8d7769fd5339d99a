"""Wrong: the reduce-scatter stops one step early (n - 2 steps): each rank's chunk misses one rank."""

import torch
import torch.distributed as dist

from exercises.solutions.ring_allreduce import _exchange, ring_all_reduce  # noqa: F401


def ring_reduce_scatter(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = torch.tensor_split(tensor.clone(), n)
    for step in range(1, n - 1):  # the bug: step 0 skipped
        send, recv = chunks[(rank - step - 1) % n], chunks[(rank - step - 2) % n]
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, (rank + 1) % n, (rank - 1) % n)
        recv += incoming
    return chunks[rank].clone()
