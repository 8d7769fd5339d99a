"""Exercise (lesson 04): a DistributedSampler by hand.

Fill in the class, then grade it:  python -m exercises distributed_sampler
(graded in one process: a sampler takes num_replicas and rank directly, no process group needed; compared
with torch.utils.data.DistributedSampler over many sizes, ranks, epochs and options).
"""

from collections.abc import Iterator

import torch


class MyDistributedSampler:
    """The indices rank `rank` of `num_replicas` reads in one epoch, exactly as
    `torch.utils.data.DistributedSampler(dataset, num_replicas, rank, shuffle, seed, drop_last)` yields them.

    Contract:
        dataset_len: the number of samples (an int here, instead of the dataset).
        Every rank yields the same number of indices, so that every rank runs the same number of steps.
        shuffle=True: the epoch's order is `torch.randperm(dataset_len, generator=g)` with
        `g = torch.Generator(); g.manual_seed(seed + epoch)`: the same on every rank, new each epoch.
        drop_last=False: pad the order by repeating it from its start until its length divides by
        num_replicas. drop_last=True: cut the order's tail instead (to the largest multiple of num_replicas
        that fits). Rank r takes every num_replicas-th index starting at r: order[r::num_replicas].

    Hint: len(self) is what THIS rank yields (not dataset_len). set_epoch(e) only stores e.
    """

    def __init__(
        self,
        dataset_len: int,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ):
        raise NotImplementedError("__init__")

    def set_epoch(self, epoch: int) -> None:
        raise NotImplementedError("set_epoch")

    def __iter__(self) -> Iterator[int]:
        raise NotImplementedError("__iter__")

    def __len__(self) -> int:
        raise NotImplementedError("__len__")
