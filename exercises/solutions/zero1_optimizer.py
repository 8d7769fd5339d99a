"""Reference solution of exercises/zero1_optimizer.py (lesson 13).

One owner per parameter (torch's ZeroRedundancyOptimizer does the same); lesson 13's common/sharding/zero.py cuts
flat, padded buffers into equal slices instead (the ZeRO paper's layout): both are right, and the grader takes
either."""

import torch.distributed as dist


class Zero1Optimizer:
    def __init__(self, params, optimizer_class: type, **kwargs):
        params = list(params)
        # as torch.optim takes them: parameters, or parameter groups ({"params": [...], "lr": ...})
        groups = params if params and isinstance(params[0], dict) else [{"params": params}]
        # frozen parameters: never updated, never sent
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
        self.params = [p for g in groups for p in g["params"]]
        rank, world = dist.get_rank(), dist.get_world_size()
        sizes = [0] * world
        self.owner = []
        for (
            p
        ) in self.params:  # greedy: the next parameter goes to the rank holding the fewest elements
            owner = min(range(world), key=lambda r: sizes[r])
            self.owner.append(owner)
            sizes[owner] += p.numel()
        mine = {id(p) for p, o in zip(self.params, self.owner) if o == rank}
        # state only for this rank's shard; every group kept, even one this rank owns nothing of (torch.optim
        # takes an empty group, not an empty list: with 2 parameters on 3 ranks one rank owns none)
        shards = [{**g, "params": [p for p in g["params"] if id(p) in mine]} for g in groups]
        self.local = optimizer_class(shards, **kwargs)

    def step(self) -> None:
        self.local.step()
        for p, owner in zip(self.params, self.owner):
            dist.broadcast(p.data, src=owner)  # every rank receives the owner's updated values

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
