"""A wrong answer to exercises/zero1_optimizer.py: the split is written for 2 ranks (rank 0 owns the first
half of the parameters, every other rank the second half): right at 2, but with 3 ranks ranks 1 and 2 both
keep state for the second half."""

import torch.distributed as dist


class Zero1Optimizer:
    def __init__(self, params, optimizer_class: type, **kwargs):
        self.params = [p for p in params if p.requires_grad]
        half = len(self.params) // 2
        self.owner = [0 if i < half else 1 for i in range(len(self.params))]
        mine = self.params[:half] if dist.get_rank() == 0 else self.params[half:]
        self.local = optimizer_class(mine, **kwargs)

    def step(self) -> None:
        self.local.step()
        for p, owner in zip(self.params, self.owner):
            dist.broadcast(p.data, src=owner)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
