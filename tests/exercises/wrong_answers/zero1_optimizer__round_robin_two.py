"""Wrong: the parameters dealt round-robin over 2 ranks (i % 2), written for a 2-rank run: at 3 ranks rank 2
owns nothing; the result is right, the memory is not sharded over every rank."""

import torch.distributed as dist

from exercises.solutions.zero1_optimizer import Zero1Optimizer as _Right


class Zero1Optimizer(_Right):
    def __init__(self, params, optimizer_class, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.owner = [i % 2 for i in range(len(self.params))]  # the bug: a fixed 2
        mine = [p for p, o in zip(self.params, self.owner) if o == dist.get_rank()]
        self.local = optimizer_class([{"params": mine}], **kwargs)
