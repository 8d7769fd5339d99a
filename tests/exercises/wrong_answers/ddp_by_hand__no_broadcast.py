"""Wrong: nothing broadcast at wrap time: each rank keeps its own initial weights."""

import torch.distributed as dist

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Right


class DataParallelByHand(_Right):
    def __init__(self, module, bucket_cap_mb=None):
        broadcast, dist.broadcast = (
            dist.broadcast,
            lambda *args, **kwargs: None,
        )  # the bug: no broadcast
        try:
            super().__init__(module, bucket_cap_mb)
        finally:
            dist.broadcast = broadcast
