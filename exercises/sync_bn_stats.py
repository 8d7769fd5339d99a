"""Exercise (lesson 06): SyncBatchNorm's statistics, the global mean and variance.

Fill in `global_mean_var`, then grade it:  python -m exercises sync_bn_stats
(3 gloo processes with batches of 2, 5 and 1 samples; compared with the statistics of the whole batch).
"""
import torch
import torch.distributed as dist


def global_mean_var(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel mean and (biased) variance over every rank's batch, as BatchNorm2d would compute them
    on all ranks' samples concatenated: what nn.SyncBatchNorm normalizes with.

    Contract:
        x: (N_r, C, H, W), this rank's batch; N_r may differ between ranks.
        Returns (mean, var), each of shape (C,), the same on every rank; var is the biased variance (divided
        by the count, as the normalization uses), over N x H x W values per channel, N the global batch.

    Hint: averaging the ranks' means or variances is wrong when batches differ in size, and the mean of
    variances also misses the spread between ranks' means. Reduce per channel the count, the sum and the sum
    of squares; then mean = sum / count and var = sum_sq / count - mean ** 2.
    """
    raise NotImplementedError("global_mean_var")
