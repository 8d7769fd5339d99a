"""Exercise (lesson 03): data parallelism by hand, the way DistributedDataParallel works inside.

Fill in the class, then grade it:  python -m exercises ddp_by_hand
(3 gloo processes with different initial weights and different data; a model with a frozen layer and a tied
weight; your wrapper must end equal to torch's DDP, start its all-reduces while backward is still running, and
make the number of all-reduces the bucket rule below gives).
"""

import torch
import torch.distributed as dist
from torch import nn


class DataParallelByHand(nn.Module):
    """Wrap `module` so that, after `loss.backward()` and `finish_gradient_sync()`, every rank's .grad holds
    the average of all ranks' gradients, with the communication overlapping backward.

    Contract:
        At wrap time: broadcast every parameter AND buffer from rank 0 (frozen ones too), so all replicas
        start equal. Register, on each trainable parameter (requires_grad=True; a tied parameter appears once
        in module.parameters(), so it gets one hook), a hook that runs as soon as backward has accumulated its
        gradient: `p.register_post_accumulate_grad_hook(hook)` (hook(p) is called with the parameter).
        bucket_cap_mb=None: each gradient is all-reduced on its own, asynchronously
            (`dist.all_reduce(..., async_op=True)` returns a work handle) as soon as it is ready.
        bucket_cap_mb=c: walk the trainable parameters in REVERSE order of module.parameters() (backward
            produces the last layers' gradients first) and put them into buckets: a bucket closes as soon as
            its gradients hold at least c * 2**20 bytes (the last bucket may hold less). When every gradient
            of a bucket is ready, flatten them into one tensor (torch.cat of .grad.flatten()) and
            all-reduce it asynchronously: ONE all-reduce per bucket per backward.
        finish_gradient_sync(): wait for every pending all-reduce, write the averaged values (the sum / world
            size) into each parameter's .grad, and reset so that the next backward starts clean.
        forward(*args) is module(*args).
        A module with no trainable parameter at all: raise RuntimeError at wrap time, as torch's DDP does
        (there is nothing to average, and a model frozen by mistake should not train nothing in silence).

    Hint: keep a list of (work handle, tensor, parameters) per backward. A hook's parameter tells you which
    bucket it belongs to; count the ready gradients per bucket.
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float | None = None):
        super().__init__()
        raise NotImplementedError("DataParallelByHand.__init__")

    def forward(self, *args):
        raise NotImplementedError("DataParallelByHand.forward")

    def finish_gradient_sync(self) -> None:
        raise NotImplementedError("DataParallelByHand.finish_gradient_sync")
