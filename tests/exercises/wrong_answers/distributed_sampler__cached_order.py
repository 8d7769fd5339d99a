"""Wrong: the order is computed on the first iteration and reused: set_epoch has no effect after it."""

import math

import torch


class MyDistributedSampler:
    """Computes the epoch's order once, on first iteration, and reuses it: set_epoch has no effect after."""

    def __init__(self, n, replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n, self.r, self.rank, self.shuffle = n, replicas, rank, shuffle
        self.seed, self.drop = seed, drop_last
        self.epoch, self._order = 0, None
        self.num = n // replicas if drop_last else math.ceil(n / replicas)

    def set_epoch(self, e):
        self.epoch = e

    def __iter__(self):
        if self._order is None:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = (
                torch.randperm(self.n, generator=g).tolist()
                if self.shuffle
                else list(range(self.n))
            )
            total = self.num * self.r
            while len(order) < total:
                order += order[: total - len(order)]
            self._order = order[:total][self.rank :: self.r]
        return iter(self._order)

    def __len__(self):
        return self.num
