"""Wrong: rank r takes a contiguous block of the (padded) order instead of every num_replicas-th index."""

import torch

from exercises.solutions.distributed_sampler import MyDistributedSampler as _Right


class MyDistributedSampler(_Right):
    def __iter__(self):
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        while len(order) < self.total_size:
            order += order[: self.total_size - len(order)]
        start = self.rank * self.num_samples  # the bug: a block, not order[rank::num_replicas]
        return iter(order[start : start + self.num_samples])
