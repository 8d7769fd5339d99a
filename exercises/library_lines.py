"""Exercise (lesson 23): the plain-torch lines that fabric.setup, setup_dataloaders and no_backward_sync run.

Fill in `prepare` and `train_epoch`, then grade them:  python -m exercises library_lines
(2 gloo processes; the grader records which samples each rank reads, counts DDP's all-reduces and compares
the parameters with one process stepping on every global batch).
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


def prepare(model: nn.Module, dataset: Dataset, batch_size: int, seed: int):
    """What fabric.setup(model) and fabric.setup_dataloaders(DataLoader(dataset, shuffle=True)) return:
    (the model wrapped in DistributedDataParallel, a DataLoader of `batch_size` samples whose sampler hands
    this rank its disjoint share of a shuffled order that depends on `seed` and the epoch).

    Hint: lesson 03's two lines; the process group already exists (rank and world size from it).
    """
    raise NotImplementedError("prepare")


def train_epoch(
    ddp_model, optimizer: torch.optim.Optimizer, loader: DataLoader, epoch: int, k: int
):
    """One epoch: an optimizer step every k micro-batches, each step equal to one SGD step on the mean
    cross-entropy over the global batch (every rank's k micro-batches). Fabric's loop would read:

        for i, (x, y) in enumerate(loader):
            last = (i + 1) % k == 0  # the k-th micro-batch of a step all-reduces
            with fabric.no_backward_sync(ddp_model, enabled=not last):  # forward AND backward inside
                loss = F.cross_entropy(ddp_model(x), y)
                fabric.backward(loss)

    Contract: the loader yields (x, y); len(loader) is a multiple of k; one all-reduce round per optimizer
    step; zero_grad after each step.

    Hint: what does _FabricDataLoader call on the sampler before each pass? fabric.backward is
    loss.backward(): unlike accelerator.backward it divides by nothing.
    """
    raise NotImplementedError("train_epoch")
