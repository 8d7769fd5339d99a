"""Wrong: no padding, so ranks yield different numbers of indices when the data does not divide evenly."""

import torch


class MyDistributedSampler:
    def __init__(self, dataset_len, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        self.n, self.replicas, self.rank, self.shuffle, self.seed, self.epoch = (
            dataset_len,
            num_replicas,
            rank,
            shuffle,
            seed,
            0,
        )

    def set_epoch(self, epoch):
        self.epoch = epoch

    def _order(self):
        if not self.shuffle:
            return list(range(self.n))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=g).tolist()

    def __iter__(self):
        return iter(self._order()[self.rank :: self.replicas])

    def __len__(self):
        return len(self._order()[self.rank :: self.replicas])
