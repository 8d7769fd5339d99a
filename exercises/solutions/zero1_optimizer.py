"""Reference solution of exercises/zero1_optimizer.py (lesson 13)."""
import torch
import torch.distributed as dist
from torch import nn


class Zero1Optimizer:
    def __init__(self, params, optimizer_class: type, **kwargs):
        self.params = [p for p in params if p.requires_grad]  # frozen parameters: never updated, never sent
        rank, world = dist.get_rank(), dist.get_world_size()
        sizes = [0] * world
        self.owner = []
        for p in self.params:  # greedy: the next parameter goes to the rank holding the fewest elements
            owner = min(range(world), key=lambda r: sizes[r])
            self.owner.append(owner)
            sizes[owner] += p.numel()
        mine = [p for p, o in zip(self.params, self.owner) if o == rank]
        self.local = optimizer_class(mine, **kwargs)  # state only for this rank's shard

    def step(self) -> None:
        self.local.step()
        for p, owner in zip(self.params, self.owner):
            dist.broadcast(p.data, src=owner)  # every rank receives the owner's updated values

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
