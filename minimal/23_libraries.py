"""Minimal 23: the plain-torch lines that Fabric's setup / setup_dataloaders / no_backward_sync run for you.

    torchrun --standalone --nproc_per_node=2 minimal/23_libraries.py --grad-accum-steps 1 --epochs 1
    torchrun --standalone --nproc_per_node=2 minimal/23_libraries.py --grad-accum-steps 2

`diff minimal/07_gradient_accumulation.py minimal/23_libraries.py`. fabric.setup(model, optimizer) is the
DDP wrap; fabric.setup_dataloaders(loader) swaps its RandomSampler for DistributedSampler(seed =
seed_everything's, else 0) and calls set_epoch before each pass; fabric.no_backward_sync(model, enabled)
is model.no_sync(); fabric.backward(loss) is loss.backward(): / k stays yours. accelerator.accumulate is
the same no_sync schedule, but accelerator.backward divides by k itself: hand it the mean, not loss / k.
The last line, the sum of the parameters, equals lesson 23's Fabric run (tests/minimal).
"""

import argparse
import json
import os
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def load_digits():
    """(train, test) as the lessons split them: 20% of each class held out, fixed by seed 0."""
    with np.load(Path(__file__).resolve().parent.parent / "data" / "digits.npz") as f:
        x = torch.from_numpy(f["images"].astype(np.float32) / 16.0).unsqueeze(1)  # (1797, 1, 8, 8)
        y = torch.from_numpy(f["labels"].astype(np.int64))  # (1797,) digits 0..9
    g, is_test = torch.Generator().manual_seed(0), torch.zeros(len(y), dtype=torch.bool)
    for c in range(10):
        idx = torch.nonzero(y == c).flatten()
        is_test[idx[torch.randperm(len(idx), generator=g)][: round(0.2 * len(idx))]] = True
    return TensorDataset(x[~is_test], y[~is_test]), TensorDataset(x[is_test], y[is_test])


def make_model() -> nn.Module:
    """The lessons' DigitsCNN: the same layers in the same order give the same initial weights."""
    return nn.Sequential(  # x (B, 1, 8, 8) -> logits (B, 10), ~38k parameters
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def train(args, rank, world_size, device) -> None:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    train_set, test_set = load_digits()  # (1438, 1, 8, 8) and (359, 1, 8, 8)
    # fabric.setup_dataloaders: shuffle=True -> DistributedSampler(dataset, shuffle=True, seed)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    raw_model = make_model().to(device)  # fabric.setup: .to(device), then DDP
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    k = args.grad_accum_steps
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # _FabricDataLoader.__iter__ does this for you
        loss_sum, seen = 0.0, 0
        optimizer.zero_grad(set_to_none=True)  # drops the last epoch's len(loader) % k micro-steps
        for micro_step, (x, y) in enumerate(loader):
            x, y = x.to(device), y.to(device)  # x (B, 1, 8, 8), y (B,)
            last = (micro_step + 1) % k == 0  # the k-th micro-step all-reduces, then steps
            with nullcontext() if last else model.no_sync():  # fabric.no_backward_sync(enabled=...)
                loss = F.cross_entropy(model(x), y) / k  # accelerator.backward divides by k for you
                loss.backward()  # fabric.backward: DDP all-reduces only when `last`
            if last:
                optimizer.step()  # every rank applies the same averaged gradient
                optimizer.zero_grad(set_to_none=True)
            loss_sum, seen = loss_sum + loss.item() * k * len(y), seen + len(y)
        sums = torch.tensor([loss_sum, seen], dtype=torch.float64, device=device)  # float64: exact
        dist.all_reduce(sums)  # (sum, count) over ranks, then divide once
        if rank == 0:  # one JSON line per epoch, full precision: a test compares it with the lesson
            print(json.dumps({"epoch": epoch + 1, "train_loss": (sums[0] / sums[1]).item()}))
    total = sum(p.detach().double().sum() for p in raw_model.parameters())  # equal on every rank
    if rank == 0:
        print(json.dumps({"param_sum": total.item()}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="per process and micro-step")
    p.add_argument("--grad-accum-steps", type=int, default=2, help="k: micro-steps per step")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))  # the device on this node; RANK is global
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: NCCL binds this process to its GPU
    if "RANK" not in os.environ:  # plain python: what torchrun would set, for a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="localhost", MASTER_PORT="0")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")  # reads those variables
    try:
        train(args, rank, world_size, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
