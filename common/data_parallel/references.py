"""What DDP is checked against (lesson 03): its run replayed in one process, and nn.DataParallel.

    model, epoch_losses = replay_on_one_process(train_set, world_size, args, device, lr_at)
    device_ids, diff = dataparallel_difference(raw_model, x)

The replay trains ONE model from the same initial weights on the same global batches, in the same order and with
the same learning-rate schedule as DDP on `world_size` ranks: rank r's chunk of a step is what
`DistributedSampler(rank=r)` gives it, and the loss is the mean over the global batch, whose gradient is DDP's
average of the ranks' gradients. Each rank's chunk is forwarded apart, so BatchNorm normalises per rank as it
does under DDP (lesson 06).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler

from common.harness.session import set_seed
from common.models import DigitsCNN

__all__ = ["dataparallel_difference", "replay_on_one_process"]


def replay_on_one_process(
    train_set, world_size: int, args, device: torch.device, lr_at: Callable
) -> tuple[nn.Module, list[float]]:
    """Train in ONE process as DDP trains on `world_size` ranks; returns the model and each epoch's mean loss.

    Args:
        train_set: a TensorDataset of images (N, 1, H, W) and labels (N,).
        world_size: the number of ranks whose global batches are replayed.
        args: the lesson's options: seed, epochs, batch_size (per rank), lr, momentum.
        device: where the one model trains.
        lr_at: the schedule, `lr_at(step, args, world_size)` -> the learning rate of optimizer step `step`.
    """
    set_seed(args.seed)
    model = DigitsCNN(image_size=train_set.tensors[0].shape[-1]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    samplers = [
        DistributedSampler(train_set, num_replicas=world_size, rank=r, shuffle=True, seed=args.seed)
        for r in range(world_size)
    ]
    step, epoch_losses = 0, []
    for epoch in range(args.epochs):
        for s in samplers:
            s.set_epoch(epoch)
        loaders = [DataLoader(train_set, batch_size=args.batch_size, sampler=s) for s in samplers]
        loss_sum, seen = 0.0, 0
        for chunks in zip(*loaders):  # chunks[r] = (x, y) that rank r trained on at this step
            losses = [F.cross_entropy(model(x.to(device)), y.to(device)) for x, y in chunks]
            loss = torch.stack(losses).mean()  # equal chunk sizes: mean of means = global mean
            for g in opt.param_groups:
                g["lr"] = lr_at(step, args, world_size)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            n = sum(len(y) for _, y in chunks)
            step, loss_sum, seen = step + 1, loss_sum + loss.item() * n, seen + n
        epoch_losses.append(loss_sum / seen)
    return model, epoch_losses


def dataparallel_difference(model: nn.Module, x: torch.Tensor) -> tuple[list[int], float]:
    """nn.DataParallel(model) against the model itself on `x`, in eval mode: (its device_ids, max |output
    difference|).

    DataParallel's device_ids are every visible GPU, [] without CUDA, and then its forward is the module's.
    In eval mode a sample's output does not depend on how the batch is split, so the two agree on GPUs too.
    """
    dp = nn.DataParallel(model).eval()
    with torch.no_grad():
        diff = (dp(x) - model(x)).abs().max().item()
    return list(dp.device_ids), diff
