"""Reference solution of exercises/ring_allreduce.py (lesson 02)."""

import torch
import torch.distributed as dist


def _exchange(send: torch.Tensor, recv: torch.Tensor, right: int, left: int) -> None:
    """Send `send` to rank `right` and receive `recv` from rank `left`, posted together.

    An empty chunk (the tensor is shorter than the ring) is not sent: what rank r sends at a step is what rank
    r + 1 receives at that step, so both sides skip the same message.
    """
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send.contiguous(), right))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, left))
    for work in dist.batch_isend_irecv(ops) if ops else []:
        work.wait()


def _reduce_scatter_in_place(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The ring's n - 1 steps of reduce-scatter on `tensor`'s chunks (views); afterwards chunk r is summed."""
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = torch.tensor_split(tensor, n)  # views into `tensor`
    for step in range(n - 1):
        # shifted by one from the minimal script's (r - s): the chunk a rank completes is its own, r
        send, recv = chunks[(rank - step - 1) % n], chunks[(rank - step - 2) % n]
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, right, left)
        recv += incoming  # at the last step, s = n - 2, recv is chunk (r - n) mod n = r
    return chunks


def ring_reduce_scatter(tensor: torch.Tensor) -> torch.Tensor:
    return _reduce_scatter_in_place(tensor.clone())[dist.get_rank()].clone()


def ring_all_reduce(tensor: torch.Tensor) -> None:
    rank, n = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % n, (rank - 1) % n
    chunks = _reduce_scatter_in_place(tensor)
    for step in range(n - 1):  # all-gather: pass the summed chunks around the ring once more
        send, recv = chunks[(rank - step) % n], chunks[(rank - step - 1) % n]
        incoming = torch.empty_like(recv)
        _exchange(send, incoming, right, left)
        recv.copy_(incoming)
