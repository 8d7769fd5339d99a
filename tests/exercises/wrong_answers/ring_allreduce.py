"""Wrong: the ring runs the other way (send to rank - 1, receive from rank + 1) with the forward schedule."""

import torch
import torch.distributed as dist

from exercises.solutions.ring_allreduce import _exchange


def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank - 1) % n, (rank + 1) % n  # the bug: the neighbours swapped
    chunks = torch.tensor_split(tensor.clone(), n)
    for step in range(n - 1):
        send, recv = chunks[(rank - step - 1) % n], chunks[(rank - step - 2) % n]
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, right, left)
        recv += incoming
    return chunks[rank].clone()


def ring_all_reduce(tensor: torch.Tensor) -> None:
    tensor.copy_(tensor)  # never reached: the reduce-scatter is graded first
