"""Wrong: self.local is built over ALL parameters and the other ranks' .grad are deleted before its step."""

import torch.distributed as dist


class Zero1Optimizer:
    """The local optimizer is built over ALL parameters; grads of others are dropped before its step."""

    def __init__(self, params, optimizer_class, **kw):
        self.params = [p for p in params if p.requires_grad]
        self.w = dist.get_world_size()
        self.local = optimizer_class(self.params, **kw)

    def step(self):
        r = dist.get_rank()
        for i, p in enumerate(self.params):
            if i % self.w != r:
                p.grad = None
        self.local.step()
        for i, p in enumerate(self.params):
            dist.broadcast(p.data, src=i % self.w)

    def zero_grad(self):
        for p in self.params:
            p.grad = None
