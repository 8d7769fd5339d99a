"""Wrong: shuffles by reseeding torch's GLOBAL generator: the right order, but every other random draw
of the program (dropout, augmentation) changes."""

import math

import torch


class MyDistributedSampler:
    """Shuffles with torch's GLOBAL generator, reseeded: clobbers every other random draw in the program."""

    def __init__(self, n, replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n, self.r, self.rank, self.shuffle = n, replicas, rank, shuffle
        self.seed, self.drop = seed, drop_last
        self.epoch = 0
        self.num = n // replicas if drop_last else math.ceil(n / replicas)

    def set_epoch(self, e):
        self.epoch = e

    def __iter__(self):
        if self.shuffle:
            torch.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n).tolist()
        else:
            order = list(range(self.n))
        total = self.num * self.r
        while len(order) < total:
            order += order[: total - len(order)]
        return iter(order[:total][self.rank :: self.r])

    def __len__(self):
        return self.num
