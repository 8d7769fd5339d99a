"""Right: the ZeRO paper's layout (lesson 13's common/sharding/zero.py): each parameter group's trainable parameters
in one flat buffer of N x ceil(n / N) elements, rank r owning slice r (the last up to N - 1 elements padding);
Adam steps the slice, an all-gather rebuilds the buffer. The ranks hold 2 x 28 = 56 state elements each where
the unsharded AdamW holds 166: the 2 extra are padding."""

import math

import torch
import torch.distributed as dist
from torch import nn


class Zero1Optimizer:
    def __init__(self, params, optimizer_class, **kwargs):
        params = list(params)
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.groups, shard_groups = [], []
        for g in groups:
            ps = [p for p in g["params"] if p.requires_grad]
            s = math.ceil(sum(p.numel() for p in ps) / self.world)
            flat = torch.zeros(self.world * s, dtype=ps[0].dtype)
            flat[: sum(p.numel() for p in ps)] = torch.cat([p.detach().reshape(-1) for p in ps])
            shard = nn.Parameter(flat[self.rank * s : (self.rank + 1) * s].clone())
            self.groups.append((ps, s, shard))
            shard_groups.append({**g, "params": [shard]})
        self.local = optimizer_class(shard_groups, **kwargs)

    def step(self):
        for ps, s, shard in self.groups:
            full = torch.zeros(self.world * s, dtype=shard.dtype)  # the padding's gradient stays 0
            full[: sum(p.numel() for p in ps)] = torch.cat([p.grad.reshape(-1) for p in ps])
            shard.grad = full[self.rank * s : (self.rank + 1) * s].clone()
        self.local.step()
        for ps, s, shard in self.groups:
            flat = torch.empty(self.world * s, dtype=shard.dtype)
            dist.all_gather_into_tensor(flat, shard.detach())
            offset = 0
            for p in ps:
                p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    def zero_grad(self):
        for ps, _, _ in self.groups:
            for p in ps:
                p.grad = None
