"""Training with tensor parallelism (lesson 10): the unsplit digits transformer and its split copy, SGD on the
same batches, their losses and the held-out loss before training."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.data import digits_split
from common.harness.grid import Grid
from common.harness.session import set_seed
from common.tensor_parallel.layers import (
    digits_transformer,
    tensor_parallelize,
)

__all__ = ["Trained", "train_both", "loss_on"]


@dataclass
class Trained:
    """The unsplit model and its split copy after training on the same batches, their losses per
    step ("unsplit", "split"), the held-out images (x (359, 8, 8), y (359,)) and the split model's
    loss on them before training."""

    full: torch.nn.Module
    split: torch.nn.Module
    losses: dict
    test: tuple
    before: float


def train_both(grid: Grid, args: argparse.Namespace) -> Trained:
    """SGD on the digits for --steps, the unsplit model and its split copy on the same batches."""
    device = grid.info.device
    set_seed(args.seed)
    full = digits_transformer(args.hidden, args.heads, layers=1).to(device)
    # every rank cuts its shards from one init
    split = tensor_parallelize(full, grid.coords["tp"], grid.size("tp"), grid.group("tp"))
    train_set, test_set = digits_split()
    images, labels = train_set.tensors
    # the same batches on every rank: tp ranks share them
    g = torch.Generator().manual_seed(args.seed)
    tx, ty = (t.to(device) for t in test_set.tensors)  # (359, 1, 8, 8), (359,)
    test = (tx.squeeze(1), ty)  # held out: less noisy than a few training batches
    before = loss_on(split, test)
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9) for m in (full, split)]
    losses = {"unsplit": [], "split": []}
    for _step in range(args.steps):
        pick = torch.randint(len(labels), (args.batch_size,), generator=g)
        x = images[pick].squeeze(1).to(device)  # (B, 8, 8): 8 tokens of 8 pixels
        y = labels[pick].to(device)
        for (name, model), opt in zip((("unsplit", full), ("split", split)), opts):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    return Trained(full, split, losses, test, before)


def loss_on(model, test) -> float:
    """The mean cross-entropy of `model` on the held-out (images, labels), without gradients."""
    with torch.no_grad():
        return F.cross_entropy(model(test[0]), test[1]).item()
