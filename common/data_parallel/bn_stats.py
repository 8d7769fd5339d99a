"""BatchNorm running statistics across ranks: read them, gather them, measure their drift, and track what the
global batch's would be (the instruments of lesson 06, also used by its tests and notebook).

Under DDP each rank holds its own BatchNorm buffers. `running_stats` flattens a model's running means and
variances into one vector, `gather_stats` puts every rank's vector side by side, `spread` measures how far the
ranks' copies are apart, `local_accuracy` scores one rank's copy, and `global_batch_tracker` keeps, beside a model,
the running statistics a BatchNorm over the global batch would have kept along the same run (the reference that
rank 0's statistics are compared with).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from common.data_parallel.sync_batchnorm import convert_sync_batchnorm
from common.harness.env import DistInfo
from common.measure.differences import nan_max

__all__ = [
    "batchnorm_modules",
    "running_stats",
    "gather_stats",
    "spread",
    "global_batch_tracker",
    "local_accuracy",
]


def batchnorm_modules(model: nn.Module) -> list[tuple[str, _BatchNorm]]:
    """(name, layer) for every BatchNorm-like layer (BatchNorm*d, nn.SyncBatchNorm, the from-scratch one)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, _BatchNorm)]


@torch.no_grad()
def running_stats(model: nn.Module) -> torch.Tensor:
    """All running means and variances of `model`'s BatchNorm layers as one float64 vector (on CPU).

    Shape: (sum over layers of 2 * C,), in module order: mean_1, var_1, mean_2, var_2, ...
    """
    parts = []
    for _, m in batchnorm_modules(model):
        if m.running_mean is not None:
            parts += [m.running_mean.double().cpu(), m.running_var.double().cpu()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def gather_stats(model: nn.Module, info: DistInfo) -> torch.Tensor:
    """(world_size, sum 2C) float64 on CPU: every rank's `running_stats`, on every rank (an all-gather)."""
    t = running_stats(model)
    if not info.distributed:
        return t.unsqueeze(0)
    t = t.to(info.device)  # NCCL moves CUDA tensors only
    out = [torch.empty_like(t) for _ in range(info.world_size)]
    dist.all_gather(out, t)
    return torch.stack(out).cpu()


def spread(stats: torch.Tensor, channels: list[int]) -> tuple[float, float]:
    """(largest max-minus-min across the rows of the running means, the same for the running variances).

    stats (R, sum 2C): one row per rank, as `gather_stats` returns; channels: C of each BatchNorm layer.
    0.0 means the R copies are bit-identical.
    """
    parts = (stats.max(0).values - stats.min(0).values).split([n for c in channels for n in (c, c)])
    return nan_max(p.max().item() for p in parts[0::2]), nan_max(
        p.max().item() for p in parts[1::2]
    )


@contextmanager
def global_batch_tracker(model: nn.Module, process_group=None) -> Iterator[nn.ModuleList]:
    """Keep, beside each BatchNorm layer of `model`, the running statistics of the GLOBAL batch (of the group).

    A forward pre-hook hands each training-mode input of a layer to a from-scratch SyncBatchNorm copy of it (own
    buffers, outside `model`: DDP never broadcasts them); one extra all-reduce per layer per forward, `model`'s
    output unchanged. Yields the copies: compare `running_stats(copies)` with `running_stats(model)`.
    """
    copies, handles = nn.ModuleList(), []
    for _, layer in batchnorm_modules(model):
        shadow = convert_sync_batchnorm(copy.deepcopy(layer), process_group)
        copies.append(shadow)

        def feed(module, inputs, shadow=shadow):
            if module.training:
                with torch.no_grad():
                    shadow(
                        inputs[0]
                    )  # updates the shadow's running statistics; returns None: input unchanged

        handles.append(layer.register_forward_pre_hook(feed))
    try:
        yield copies
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def local_accuracy(model: nn.Module, dataset, batch_size: int = 128) -> float:
    """Accuracy of THIS rank's `model` (its own running statistics) on the whole TensorDataset, no communication.

    Evaluates in eval mode, in batches of `batch_size` (the test set of 359 digits: 3 forwards), and restores the
    mode it found. A DDP wrapper may be passed: its forwards run under no_grad (lesson 06 counts what DDP sends).
    """
    was_training, device = model.training, next(model.parameters()).device
    model.eval()
    x, y = dataset.tensors
    correct = sum(
        (model(xb.to(device)).argmax(1).cpu() == yb).sum().item()
        for xb, yb in zip(x.split(batch_size), y.split(batch_size))
    )
    model.train(was_training)
    return correct / len(y)
