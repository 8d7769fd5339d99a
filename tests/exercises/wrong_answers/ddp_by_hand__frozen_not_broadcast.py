"""Wrong: only the trainable parameters (and the buffers) broadcast at wrap time: the frozen layer keeps each
rank's own initial weights, and the replicas compute different forwards."""

import torch

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Right


class DataParallelByHand(_Right):
    def __init__(self, module, bucket_cap_mb=None):
        frozen = [p.detach().clone() for p in module.parameters() if not p.requires_grad]
        super().__init__(module, bucket_cap_mb)
        with torch.no_grad():  # the bug, replayed: the frozen ones back to this rank's own values
            for p, mine in zip([p for p in module.parameters() if not p.requires_grad], frozen):
                p.copy_(mine)
