"""Wrong: always pads, whatever drop_last says: with drop_last=True each rank yields too many indices."""

import math

from exercises.solutions.distributed_sampler import MyDistributedSampler as _Right


class MyDistributedSampler(_Right):
    def __init__(self, dataset_len, num_replicas, rank, shuffle=True, seed=0, drop_last=False):
        super().__init__(dataset_len, num_replicas, rank, shuffle, seed, drop_last=False)  # the bug
        self.num_samples = (
            dataset_len // num_replicas if drop_last else math.ceil(dataset_len / num_replicas)
        )
