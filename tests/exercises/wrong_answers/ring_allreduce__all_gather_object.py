"""Wrong: all_gather_object (a collective of pickled objects) instead of a ring of isend/irecv."""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, tensor.clone())
    tensor.copy_(sum(out))


def ring_reduce_scatter(tensor):
    total = tensor.clone()
    ring_all_reduce(total)
    return torch.tensor_split(total, dist.get_world_size())[dist.get_rank()].clone()
