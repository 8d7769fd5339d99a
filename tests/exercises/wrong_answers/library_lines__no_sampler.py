"""Wrong: DDP with a plain shuffled DataLoader: every rank reads the whole dataset, in the same order."""

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader


def prepare(model, dataset, batch_size, seed):
    torch.manual_seed(seed)  # the bug: no DistributedSampler, the same shuffle on every rank
    return DDP(model), DataLoader(dataset, batch_size=batch_size, shuffle=True)


def train_epoch(ddp_model, optimizer, loader, epoch, k):
    for micro_step, (x, y) in enumerate(loader):
        last = (micro_step + 1) % k == 0
        with contextlib.nullcontext() if last else ddp_model.no_sync():
            (nn.functional.cross_entropy(ddp_model(x), y) / k).backward()
        if last:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
