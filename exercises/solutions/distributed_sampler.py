"""Reference solution of exercises/distributed_sampler.py (lesson 04)."""

import math
from collections.abc import Iterator

import torch


class MyDistributedSampler:
    def __init__(
        self,
        dataset_len: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        self.dataset_len, self.num_replicas, self.rank = dataset_len, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.epoch = shuffle, seed, drop_last, 0
        if drop_last:
            self.num_samples = dataset_len // num_replicas  # cut the tail
        else:
            self.num_samples = math.ceil(dataset_len / num_replicas)  # pad to a multiple
        self.total_size = self.num_samples * num_replicas

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(
                self.seed + self.epoch
            )  # the same order on every rank, a new one each epoch
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        if self.drop_last:
            order = order[: self.total_size]
        else:
            while (
                len(order) < self.total_size
            ):  # repeat from the start (several times if the data is tiny)
                order += order[: self.total_size - len(order)]
        return iter(order[self.rank : self.total_size : self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples
