"""Wrong: __len__ returns the dataset's length, not what this rank yields (a myth: DataLoader then expects
num_replicas times too many batches)."""

from exercises.solutions.distributed_sampler import MyDistributedSampler as _Right


class MyDistributedSampler(_Right):
    def __len__(self):
        return self.dataset_len  # the bug
