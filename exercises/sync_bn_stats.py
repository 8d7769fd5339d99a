"""Exercise (lesson 06): SyncBatchNorm's statistics, the global mean and variance.

Fill in `global_mean_var`, then grade it:  python -m exercises sync_bn_stats
(3 gloo processes with batches of 2, 5 and 1 samples; compared with the statistics of the whole batch, on
float64 batches whose means differ from rank to rank and on float32 batches near 300 with a spread of 0.05).
"""

import torch
import torch.distributed as dist


def global_mean_var(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel mean and (biased) variance over every rank's batch, as BatchNorm2d would compute them
    on all ranks' samples concatenated: what nn.SyncBatchNorm normalizes with.

    Contract:
        x: (N_r, C, H, W), this rank's batch, float32 or float64; N_r may differ between ranks.
        Returns (mean, var), each of shape (C,), the same on every rank; var is the biased variance (divided
        by the count, as the normalization uses), over N x H x W values per channel, N the global batch.
        float32 inputs must keep float32's accuracy: a variance of 2.5e-3 at values near 300 within 1e-6.

    Hint: averaging the ranks' means or variances is wrong when batches differ in size, and the mean of
    variances also misses the spread between ranks' means. Reduce per channel the count and the sum: that
    gives the mean. For the variance, sum_sq / count - mean ** 2 is exact on paper and useless in float32
    near 300 (two numbers of ~9e4 whose difference is 2.5e-3): what can you reduce once the mean is known?
    """
    raise NotImplementedError("global_mean_var")
