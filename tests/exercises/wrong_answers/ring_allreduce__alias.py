"""Wrong: dist.all_reduce bound at import (`from torch.distributed import all_reduce`), out of reach of a
ban that patches only torch.distributed."""

import torch
import torch.distributed as dist
from torch.distributed import all_reduce as _sum_everywhere  # bound before the grader patches dist


def ring_reduce_scatter(tensor):
    total = tensor.clone()
    _sum_everywhere(total)
    return torch.tensor_split(total, dist.get_world_size())[dist.get_rank()].clone()


def ring_all_reduce(tensor):
    _sum_everywhere(tensor)
