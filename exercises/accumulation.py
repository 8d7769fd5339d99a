"""Exercise (lesson 07): gradient accumulation under DDP, with no_sync, over micro-batches of different sizes.

Fill in `accumulation_step`, then grade it:  python -m exercises accumulation
(2 gloo processes; the grader counts DDP's all-reduces and compares the parameters with one process that
takes one step on the global batch).
"""

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def accumulation_step(
    ddp_model: DDP,
    optimizer: torch.optim.Optimizer,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """One optimizer step over k = len(micro_batches) micro-batches of this rank, equal to one step on the
    global batch (every rank's micro-batches together) with the mean cross-entropy loss over its samples.

    Contract:
        ddp_model: the model wrapped in DistributedDataParallel; micro_batches: [(x, y), ...] whose sizes may
        differ (here 5, 5, 5 and 1: the last micro-batch of an epoch is often short); every rank holds the
        same number of samples in total. DDP must all-reduce once per optimizer step, not once per
        micro-batch: the first k - 1 forward AND backward passes run inside `ddp_model.no_sync()`; the last
        runs outside it. Then step, then zero_grad.

    Hint: each backward ADDS into .grad. Lesson 07 divides each micro-batch's mean loss by k, which is the
    mean over the rank's samples only when the micro-batches are equal: here a 1-sample micro-batch would
    weigh as much as a 5-sample one. What should each sample's loss be divided by? (DDP then averages over
    the ranks.) no_sync must wrap the forward too: DDP decides during forward whether this backward will
    synchronize.
    """
    raise NotImplementedError("accumulation_step")
