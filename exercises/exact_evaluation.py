"""Exercise (lesson 05): exact accuracy over unpadded, uneven shards.

Fill in `global_accuracy`, then grade it:  python -m exercises exact_evaluation
(3 gloo processes, each holding a different number of test samples, one holding none).
"""
import torch
import torch.distributed as dist
from torch import nn


def global_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """The accuracy of `model` over the union of every rank's shard, the same number on every rank.

    Contract:
        x: (n_r, features) and y: (n_r,) class labels: this rank's shard. n_r differs between ranks and may be
        0 (an unpadded split: no sample is counted twice, as DistributedSampler's padding would).
        Returns correct / total over all ranks, as a Python float; 0.0 would be wrong for an empty shard's
        rank: every rank returns the global number.

    Hint: the mean of the ranks' accuracies is not the global accuracy when shards differ in size. Reduce two
    numbers instead: the count of correct predictions and the count of samples (one all_reduce of a tensor of
    2). Evaluate without building a graph (torch.no_grad) and in eval mode.
    """
    raise NotImplementedError("global_accuracy")
