"""Wrong: the right reduce-scatter, followed by the minimal script's all-gather, which expects rank r to hold
the finished chunk (r + 1) mod n: it sends a partial chunk around."""

import torch
import torch.distributed as dist

from exercises.solutions.ring_allreduce import (
    _exchange,
    _reduce_scatter_in_place,
    ring_reduce_scatter,  # noqa: F401
)


def ring_all_reduce(tensor):
    rank, n = dist.get_rank(), dist.get_world_size()
    chunks = _reduce_scatter_in_place(tensor)
    for step in range(n - 1):
        send, recv = (
            chunks[(rank + 1 - step) % n],
            chunks[(rank - step) % n],
        )  # the bug: one chunk off
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, (rank + 1) % n, (rank - 1) % n)
        recv.copy_(incoming)
