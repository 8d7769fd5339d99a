"""BatchNorm running statistics across ranks: read them, gather them, measure their drift, and track what the
global batch's would be (the instruments of lesson 06, also used by its tests and notebook).

Under DDP each rank holds its own BatchNorm buffers. `running_stats` flattens a model's running means and
variances into one vector, `gather_stats` puts every rank's vector side by side, `spread` measures how far the
ranks' copies are apart, `local_accuracy` scores one rank's copy, and `global_batch_tracker` keeps, beside a model,
the running statistics a BatchNorm over the global batch would have kept along the same run (the reference that
rank 0's statistics are compared with). `replay` computes rank 0's end state of a DDP run in one process (lesson
06 checks it against the run; notebook 06 sweeps the per-rank batch with it), on the batches `loader_for` and
`batches` give each rank; `train_counted` is the lesson's DDP training loop, counting each collective.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import DataLoader, DistributedSampler

from common.data_parallel.sync_batchnorm import convert_sync_batchnorm
from common.harness.env import DistInfo
from common.harness.session import set_seed
from common.measure.counters import CommCounter, count_collectives
from common.measure.differences import nan_max
from common.models import DigitsCNN

__all__ = [
    "batchnorm_modules",
    "running_stats",
    "gather_stats",
    "spread",
    "global_batch_tracker",
    "local_accuracy",
    "loader_for",
    "batches",
    "replay",
    "train_counted",
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
                # updates the shadow's running statistics; returns None: the input is unchanged
                with torch.no_grad():
                    shadow(inputs[0])

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


def loader_for(train_set, batch_size: int, world_size: int, rank: int, seed: int) -> DataLoader:
    """Rank `rank`'s batches of `batch_size` from its DistributedSampler, shuffled by `seed`."""
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=seed)
    return DataLoader(train_set, batch_size=batch_size, sampler=sampler)


def batches(loader: DataLoader, steps: int):
    """`steps` (x, y) batches over as many epochs as needed (set_epoch reshuffles each, alike everywhere)."""
    # lazy: one epoch at a time
    epochs = (loader.sampler.set_epoch(epoch) or loader for epoch in itertools.count())
    return itertools.islice(itertools.chain.from_iterable(epochs), steps)


def replay(
    variant: str,
    train_set,
    batch_size: int,
    world_size: int,
    steps: int,
    lr: float,
    seed: int,
    momentum: float = 0.9,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Rank 0's end state of `world_size` DDP ranks, in one process on the run's device (CPU and CUDA round
    apart, 0.2 after 60 steps on an H200): each rank's micro-batch from its own DistributedSampler; "syncbn"
    normalises their concatenation, "batchnorm" each alone (rank 0's updates the statistics); gradients
    averaged as DDP does."""
    set_seed(seed)
    model = DigitsCNN().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    layers = batchnorm_modules(model)
    loaders = [loader_for(train_set, batch_size, world_size, r, seed) for r in range(world_size)]
    for micro in zip(*(batches(loader, steps) for loader in loaders)):  # one (x, y) per rank
        optimizer.zero_grad(set_to_none=True)
        if variant == "syncbn":  # one batch, the concatenation: SyncBatchNorm's statistics
            micro = [(torch.cat([x for x, _ in micro]), torch.cat([y for _, y in micro]))]
        # rank 0 last: it leaves momentum at 0.1
        for rank, (x, y) in reversed(list(enumerate(micro))):
            for _, m in layers:
                m.momentum = (
                    0.1 if rank == 0 else 0.0
                )  # 0: ranks 1.. leave rank 0's statistics alone
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            (loss / len(micro)).backward()  # DDP's average
        optimizer.step()
    return model


def train_counted(model, raw_model, data, args, info: DistInfo, log=None) -> dict:
    """Lesson 06's training loop: SGD (args.lr, args.momentum) over `data`; counts the collectives of the
    first step (forward, backward, DDP's bucket all-reduces) and times each step; `log(step)` every 10 steps.
    Returns {"steps", "final_loss", "collectives_per_step", "mean_step_s"}."""
    optimizer = torch.optim.SGD(raw_model.parameters(), lr=args.lr, momentum=args.momentum)
    comm = CommCounter().register(model) if info.distributed else CommCounter()
    counts, times = {}, []
    for step, (x, y) in enumerate(data, 1):
        x, y = x.to(info.device), y.to(info.device)  # x (B, 1, 8, 8), B = samples on this rank
        t0 = time.perf_counter()
        with count_collectives() as fwd:
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        with count_collectives() as bwd:
            loss.backward()  # SyncBatchNorm's backward all-reduces; DDP all-reduces gradient buckets
        optimizer.step()
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        if (
            step == 1
        ):  # the comm hook calls dist.all_reduce too: take DDP's buckets out of "backward"
            counts = {
                "forward": fwd.total,
                "backward": bwd.total - comm.calls,
                "ddp_buckets": comm.calls,
            }
        if log and step % 10 == 0:
            log(step)
    warm = times[min(5, len(times) - 1) :]  # skip the first steps (allocation, counting)
    return {
        "steps": len(times),
        "final_loss": loss.item(),
        "collectives_per_step": counts,
        "mean_step_s": sum(warm) / len(warm),
    }
