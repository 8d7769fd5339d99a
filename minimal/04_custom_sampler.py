"""Minimal 04: DistributedSampler by hand -- minimal/03 with the sampler written out.

    torchrun --standalone --nproc_per_node=2 minimal/04_custom_sampler.py --epochs 2
    python minimal/04_custom_sampler.py                             # plain python: a world of one

`diff minimal/03_ddp.py minimal/04_custom_sampler.py`: `shard_indices` replaces DistributedSampler:
every rank draws the SAME permutation of (seed, epoch), pads it with its start to a multiple of the
world size and keeps every world_size-th index from its rank. Checked against torch's; lessons/04.
"""

import argparse
import json
import math
import os
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


def shard_indices(n: int, world_size: int, rank: int, seed: int, epoch: int) -> list[int]:
    """DistributedSampler(shuffle=True)'s indices for `rank` in `epoch`: ceil(n / W), not n."""
    g = torch.Generator().manual_seed(seed + epoch)  # the same seed on every rank ...
    order = torch.randperm(n, generator=g).tolist()  # ... so the same permutation: no communication
    total = math.ceil(n / world_size) * world_size  # pad: 11 samples on 2 ranks -> 12 positions
    order = (order * math.ceil(total / n))[:total]  # the padding repeats the permutation's start
    return order[rank::world_size]  # rank r: positions r, r + W, r + 2W, ... (a stride)


def train(args, rank, world_size, device) -> None:
    # --- data and model ---
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    train_set, test_set = load_digits()  # (1438, 1, 8, 8) and (359, 1, 8, 8)
    raw_model = make_model().to(device)  # wrap order: .to(device), then DDP
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)

    # --- the training loop ---
    for epoch in range(args.epochs):
        indices = shard_indices(len(train_set), world_size, rank, args.seed, epoch)  # 719 of 1438
        loader = DataLoader(train_set, batch_size=args.batch_size, sampler=indices)
        loss_sum, seen = 0.0, 0
        for x, y in loader:
            x, y = x.to(device), y.to(device)  # x (B, 1, 8, 8), y (B,)
            loss = F.cross_entropy(model(x), y)  # mean over the B samples
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients, bucket by bucket
            optimizer.step()  # every rank applies the same averaged gradient
            loss_sum, seen = loss_sum + loss.item() * len(y), seen + len(y)
        sums = torch.tensor([loss_sum, seen], dtype=torch.float64, device=device)  # float64: exact
        dist.all_reduce(sums)  # (sum, count) over ranks, then divide once
        if rank == 0:  # one JSON line per epoch, full precision: a test compares it with the lesson
            print(json.dumps({"epoch": epoch + 1, "train_loss": (sums[0] / sums[1]).item()}))

    # --- the check: torch's DistributedSampler gives the same indices, on any size and rank ---
    for n, w in [(1, 4), (11, 2), (11, 3), (len(train_set), world_size)]:  # (1, 4): 3 repeats
        for r in range(w):
            reference = DistributedSampler(range(n), num_replicas=w, rank=r, seed=args.seed)
            reference.set_epoch(args.epochs)
            assert shard_indices(n, w, r, args.seed, args.epochs) == list(reference), (n, w, r)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    # --- setup: one process per device, started by torchrun (which sets RANK, WORLD_SIZE, ...) ---
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
