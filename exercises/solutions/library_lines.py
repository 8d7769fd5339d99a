"""Reference solution of exercises/library_lines.py (lesson 23)."""

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def prepare(model: nn.Module, dataset: Dataset, batch_size: int, seed: int):
    # fabric.setup_dataloaders: the RandomSampler of shuffle=True becomes a seeded DistributedSampler
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed)
    return DDP(model), DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def train_epoch(
    ddp_model, optimizer: torch.optim.Optimizer, loader: DataLoader, epoch: int, k: int
):
    loader.sampler.set_epoch(epoch)  # _FabricDataLoader.__iter__ does this for you
    for micro_step, (x, y) in enumerate(loader):
        last = (micro_step + 1) % k == 0
        with contextlib.nullcontext() if last else ddp_model.no_sync():  # no_backward_sync
            loss = nn.functional.cross_entropy(ddp_model(x), y) / k  # the mean of k means
            loss.backward()  # fabric.backward: DDP all-reduces only when `last`
        if last:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
