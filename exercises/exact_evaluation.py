"""Exercise (lesson 05): exact accuracy, overall and per class, over unpadded, uneven shards.

Fill in `global_accuracy`, then grade it:  python -m exercises exact_evaluation
(3 gloo processes, each holding a different number of test samples, one holding none; a class that only
some ranks hold).
"""

import torch
import torch.distributed as dist
from torch import nn


def global_accuracy(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int
) -> tuple[float, list[float]]:
    """The accuracy of `model` over the union of every rank's shard, overall and per class, the same
    numbers on every rank.

    Contract:
        x: (n_r, features) and y: (n_r,) class labels in 0 .. num_classes - 1: this rank's shard. n_r
        differs between ranks and may be 0 (an unpadded split: no sample is counted twice, as
        DistributedSampler's padding would). Every class has a sample on some rank, not on every rank.
        Returns (overall, per_class): overall = correct / total over all ranks, a Python float; per_class, a
        list of num_classes floats: per_class[c] = of all ranks' samples labelled c, the fraction predicted
        c (the recall of class c). Every rank returns the global numbers, the empty shard's too.

    Hint: lesson 05 reduces two numbers, a sum and a count, and divides once. A rank's per-class accuracy
    is a ratio too: averaging ratios over ranks weighs a rank holding 1 sample of a class like one holding
    100 (and a rank holding none of it has no ratio at all). What would you reduce instead, per class?
    torch.bincount(..., minlength=num_classes) counts per class. Evaluate in eval mode, without a graph.
    """
    raise NotImplementedError("global_accuracy")
