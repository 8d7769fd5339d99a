"""The micro-batches of gradient accumulation (lessons 07, 08, 17, 18): each rank's stream of them, `no_sync` on
every micro-step but the last, and a GradScaler that counts its calls."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["CountingScaler", "no_sync_unless", "micro_batch_stream"]


class CountingScaler(torch.amp.GradScaler):
    """A GradScaler that counts its unscale_/step/update calls: under accumulation each must run once per
    optimizer step, after the last micro-step (lesson 08 claims it)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counts = {"unscale_": 0, "step": 0, "update": 0}

    def unscale_(self, optimizer):
        self.counts["unscale_"] += 1
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.counts["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.counts["update"] += 1
        return super().update(new_scale)


def no_sync_unless(model: nn.Module, last: bool):
    """`model.no_sync()` on every micro-step but the last under DDP; nothing to skip without DDP.

    Use it around the forward AND the backward: DDP arms its reducer in the forward (lesson 07 counts it).
    """
    return model.no_sync() if isinstance(model, DDP) and not last else nullcontext()


def micro_batch_stream(
    dataset: Dataset, micro_batch: int, world_size: int, rank: int, seed: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s micro-batches of `micro_batch` samples, forever: its `DistributedSampler` shard, reshuffled
    at each pass by `set_epoch(epoch)`, the last incomplete micro-batch dropped (so every micro-batch has the
    same size and k of them average to the mean over k x micro_batch samples)."""
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed
    )
    loader = DataLoader(dataset, batch_size=micro_batch, sampler=sampler, drop_last=True)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1
