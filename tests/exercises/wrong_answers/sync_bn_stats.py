"""Wrong: the rank with a single sample skips the all-reduce ("one sample has no variance"): the other ranks
wait in a collective it never calls. Graded last: the waiting ranks fail when it leaves."""

import torch

from exercises.solutions.sync_bn_stats import global_mean_var as _right


def global_mean_var(x):
    if x.shape[0] == 1:  # the bug: a collective under a condition that differs between ranks
        return torch.var_mean(x, dim=(0, 2, 3), unbiased=False)[::-1]
    return _right(x)
