"""Wrong: Accelerate's habit under Fabric: the loss handed to backward as it is (accelerator.backward divides
by k; fabric.backward, loss.backward(), does not): a k-times update."""

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
            nn.functional.cross_entropy(ddp_model(x), y).backward()  # the bug: not / k
        if last:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
