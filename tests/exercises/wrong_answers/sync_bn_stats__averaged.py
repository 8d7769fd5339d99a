"""Wrong: the average of the ranks' means and variances."""

import torch
import torch.distributed as dist


def global_mean_var(x):
    var, mean = torch.var_mean(x, dim=(0, 2, 3), unbiased=False)
    stats = torch.stack([mean, var])
    dist.all_reduce(stats)
    stats /= dist.get_world_size()
    return stats[0], stats[1]
