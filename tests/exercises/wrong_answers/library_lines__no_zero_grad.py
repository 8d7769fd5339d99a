"""Wrong: no zero_grad after the step: every step's gradient carries the ones before it."""

import contextlib

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def prepare(model, dataset, batch_size, seed):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(dataset, world_size, rank, shuffle=True, seed=seed)
    return DDP(model), DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def train_epoch(ddp_model, optimizer, loader, epoch, k):
    loader.sampler.set_epoch(epoch)
    for micro_step, (x, y) in enumerate(loader):
        last = (micro_step + 1) % k == 0
        with contextlib.nullcontext() if last else ddp_model.no_sync():
            (nn.functional.cross_entropy(ddp_model(x), y) / k).backward()
        if last:
            optimizer.step()
            # the bug: no optimizer.zero_grad(): the next step adds onto this step's gradients
