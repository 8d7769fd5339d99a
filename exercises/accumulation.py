"""Exercise (lesson 07): gradient accumulation under DDP, with no_sync and the loss divided by k.

Fill in `accumulation_step`, then grade it:  python -m exercises accumulation
(2 gloo processes; the grader counts DDP's all-reduces and compares the parameters with one process that
takes one step on the global batch).
"""
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def accumulation_step(ddp_model: DDP, optimizer: torch.optim.Optimizer,
                      micro_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One optimizer step over k = len(micro_batches) micro-batches of this rank, equal to one step on the
    global batch (every rank's micro-batches together) with the mean cross-entropy loss.

    Contract:
        ddp_model: the model wrapped in DistributedDataParallel; micro_batches: [(x, y), ...], equal sizes.
        DDP must all-reduce once per optimizer step, not once per micro-batch: the first k - 1 forward AND
        backward passes run inside `ddp_model.no_sync()`; the last runs outside it. Then step, then zero_grad.

    Hint: each backward ADDS into .grad, so k backward passes of the mean loss sum k means: divide each
    micro-batch's loss by k to get the mean over the rank's batch (DDP then averages over ranks).
    no_sync must wrap the forward too: DDP decides during forward whether this backward will synchronize.
    """
    raise NotImplementedError("accumulation_step")
