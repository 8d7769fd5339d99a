"""Exercise (lesson 13): a sharded optimizer (ZeRO stage 1) around any torch.optim optimizer.

Fill in the class, then grade it:  python -m exercises zero1_optimizer
(3 gloo processes; after 3 steps with AdamW and with SGD + momentum, the parameters must equal the unsharded
optimizer's, and each rank must hold optimizer state for its own shard only; also with parameter groups, and
with a model of 2 parameters on 3 ranks).
"""

import torch
import torch.distributed as dist
from torch import nn


class Zero1Optimizer:
    """Each rank keeps optimizer state (Adam's moments, momentum buffers) for its shard of the parameters
    only, updates that shard, and sends the updated values to the other ranks.

    Contract:
        params: what torch.optim takes, the same on every rank (the model is replicated, as in DDP): an
        iterable of parameters, or of parameter groups ({"params": [...], "lr": 0.05}: each group's options
        apply to its own parameters); optimizer_class, **kwargs: any torch.optim optimizer and its arguments,
        e.g. (torch.optim.AdamW, lr=1e-2). step(): the gradients are already averaged over ranks (DDP, or an
        all-reduce); when it returns, every rank's parameters equal what `optimizer_class(params,
        **kwargs).step()` would give (an async collective waited on). zero_grad(): set every parameter's .grad
        to None. self.local: the torch.optim optimizer this rank steps (holding state for its shard only).
        Parameters with requires_grad=False are frozen: never updated (skip them, as torch.optim skips a None
        grad). A rank may own no parameter at all (2 parameters on 3 ranks).
        A shard may be whole parameters (each owned by one rank) or equal slices of a flat buffer padded to
        N x ceil(n / N) elements (the ZeRO paper's layout, lesson 13's): padding of up to N - 1 elements per
        buffer is fine.

    Hint: give each parameter an owner rank (for example greedily: the next parameter goes to the rank that
    owns the fewest elements so far), build `optimizer_class(my_params, **kwargs)`, and after its step
    broadcast each parameter from its owner (dist.broadcast(p.data, src=owner)). torch.optim refuses an
    empty list of parameters but takes an empty group, [{"params": []}].
    """

    def __init__(self, params, optimizer_class: type, **kwargs):
        raise NotImplementedError("Zero1Optimizer.__init__")

    def step(self) -> None:
        raise NotImplementedError("Zero1Optimizer.step")

    def zero_grad(self) -> None:
        raise NotImplementedError("Zero1Optimizer.zero_grad")
