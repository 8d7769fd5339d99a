"""Wrong: async_op=True, but waited on at once inside the hook: no all-reduce overlaps the rest of
backward."""

import torch
import torch.distributed as dist

from exercises.solutions.ddp_by_hand import DataParallelByHand as _Ref


class DataParallelByHand(_Ref):
    """async_op=True, but waited on at once inside the hook: backward stalls on every bucket (no overlap)."""

    def _grad_ready(self, p):
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):
            flat = torch.cat([q.grad.flatten() for q in self.buckets[i]])
            work = dist.all_reduce(flat, async_op=True)
            work.wait()
            flat /= dist.get_world_size()
            off = 0
            for q in self.buckets[i]:
                q.grad.copy_(flat[off : off + q.numel()].view_as(q.grad))
                off += q.numel()

    def finish_gradient_sync(self):
        self.ready = [0] * len(self.buckets)
