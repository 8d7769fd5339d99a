"""Reference solution of exercises/accumulation.py (lesson 07)."""

import contextlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def accumulation_step(
    ddp_model: DDP,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    k = len(micro_batches)
    samples = sum(len(y) for _, y in micro_batches)  # this rank's samples, over every micro-batch
    for micro_step, (x, y) in enumerate(micro_batches):
        last = micro_step == k - 1
        with (
            contextlib.nullcontext() if last else ddp_model.no_sync()
        ):  # forward AND backward inside
            # every sample weighs 1 / samples, whatever the size of its micro-batch (the mean of k means,
            # loss / k, is that only when the micro-batches are equal); DDP then averages over the ranks
            loss = nn.functional.cross_entropy(ddp_model(x), y, reduction="sum") / samples
            loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
