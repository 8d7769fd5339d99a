"""Wrong: every parameter broadcast at wrap time, but not the buffers (a BatchNorm's running statistics, the
model's `scale`): each rank keeps its own."""

import torch

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Right


class DataParallelByHand(_Right):
    def __init__(self, module, bucket_cap_mb=None):
        buffers = [b.detach().clone() for b in module.buffers()]
        super().__init__(module, bucket_cap_mb)
        with torch.no_grad():  # the bug, replayed: the buffers back to this rank's own values
            for b, mine in zip(module.buffers(), buffers):
                b.copy_(mine)
