"""Wrong: the right indices for the rank, sorted ("for locality"): the shuffle is undone within the rank."""

from exercises.solutions.distributed_sampler import MyDistributedSampler as _Right


class MyDistributedSampler(_Right):
    def __iter__(self):
        return iter(sorted(super().__iter__()))
