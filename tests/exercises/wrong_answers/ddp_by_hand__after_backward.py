"""Wrong: async all-reduces, but all launched from finish_gradient_sync, after backward has finished: nothing
overlaps backward."""

import torch
import torch.distributed as dist

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Right


class DataParallelByHand(_Right):
    def _grad_ready(self, p):
        pass  # the bug: nothing sent during backward

    def finish_gradient_sync(self):
        for bucket in self.buckets:
            flat = torch.cat([q.grad.flatten() for q in bucket])
            self.pending.append((dist.all_reduce(flat, async_op=True), flat, bucket))
        super().finish_gradient_sync()
