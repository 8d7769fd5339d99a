"""Wrong: a full optimizer (state for every parameter) kept beside `local`, which only holds copies."""

import torch.distributed as dist


class Zero1Optimizer:
    """Every rank keeps a full optimizer (state for all parameters); `local` is only for show."""

    def __init__(self, params, optimizer_class, **kw):
        self.params = [p for p in params if p.requires_grad]
        r, w = dist.get_rank(), dist.get_world_size()
        self.full = optimizer_class(self.params, **kw)
        # "local": all params in param_groups, but non-owned never get a grad -> no state created
        self.owner = [i % w for i in range(len(self.params))]
        self.local = optimizer_class([p for p, o in zip(self.params, self.owner) if o == r], **kw)

    def step(self):
        self.full.step()  # state for every parameter on every rank
        self.local.state.update({})  # untouched
        for p, o in zip(self.params, self.owner):
            if o == dist.get_rank():
                self.local.state[p] = {k: v for k, v in self.full.state[p].items()}

    def zero_grad(self):
        for p in self.params:
            p.grad = None
