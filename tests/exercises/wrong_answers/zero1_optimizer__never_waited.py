"""Wrong: the broadcasts launched with async_op=True and never waited on: step() returns while the updated
values may still be on their way (on gloo the receiving thread may not have written them yet)."""

import torch.distributed as dist

from exercises.solutions.zero1_optimizer import Zero1Optimizer as _Right


class Zero1Optimizer(_Right):
    def step(self):
        self.local.step()
        for p, owner in zip(self.params, self.owner):
            dist.broadcast(p.data, src=owner, async_op=True)  # the bug: the work is dropped
