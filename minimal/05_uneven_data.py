"""Minimal 05: uneven data -- exact evaluation on unpadded shards, Join for uneven training shards.

    torchrun --standalone --nproc_per_node=2 minimal/05_uneven_data.py --epochs 1
    python minimal/05_uneven_data.py                                # plain python: a world of one

`diff minimal/03_ddp.py minimal/05_uneven_data.py`. Test image i goes to rank i % W (180 + 179, no
padding): ranks add (loss sum, correct, count), divide once. Rank r trains on 4 + r batches: under Join
a rank that ran out shadows DDP's all-reduces (without, the others wait until the timeout).
"""

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


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
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),  # no BatchNorm (lesson 06), no dropout: train() and eval() compute alike
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    """[mean loss, accuracy] of the whole test set, from this rank's unpadded shard (x, y)."""
    logits = model(x)  # (shard, 10); a shard may be empty, its rank still joins the all-reduce
    loss_sum = F.cross_entropy(logits, y, reduction="sum").item()
    correct = (logits.argmax(dim=1) == y).sum().item()
    sums = torch.tensor([loss_sum, correct, len(y)], dtype=torch.float64, device=x.device)
    dist.all_reduce(sums)  # each rank evaluated its shard: add the sums, then divide once
    return (sums[:2] / sums[2]).tolist()


def train(args, rank, world_size, device) -> None:
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    train_set, test_set = load_digits()  # (1438, 1, 8, 8) and (359, 1, 8, 8)
    x_test, y_test = (t.to(device) for t in test_set[rank::world_size])  # 180 or 179 of 359
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    raw_model = make_model().to(device)  # wrap order: .to(device), then DDP
    model = DDP(raw_model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)  # no momentum: Join syncs no state
    test_loss, test_accuracy = evaluate(raw_model, x_test, y_test)  # raw_model: not DDP
    if rank == 0:  # untrained: ln 10 = 2.30 and 0.10 are chance on 10 digits
        print(json.dumps({"test_loss": test_loss, "test_accuracy": test_accuracy}))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new order every epoch (without it: epoch 0's order forever)
        shard = list(sampler)[: (4 + rank) * args.batch_size]  # rank r: 4 + r batches, uneven
        loader = DataLoader(Subset(train_set, shard), batch_size=args.batch_size)
        loss_sum, seen = 0.0, 0
        with Join([model]):  # no collective of our own inside: Join shadows DDP's only
            for x, y in loader:
                x, y = x.to(device), y.to(device)  # x (B, 1, 8, 8), y (B,)
                loss = F.cross_entropy(model(x), y)  # mean over the B samples
                optimizer.zero_grad(set_to_none=True)
                loss.backward()  # DDP all-reduces (averages) the gradients, bucket by bucket
                optimizer.step()  # every rank applies the same averaged gradient
                loss_sum, seen = loss_sum + loss.item() * len(y), seen + len(y)
        sums = torch.tensor([loss_sum, seen], dtype=torch.float64, device=device)  # float64: exact
        dist.all_reduce(sums)  # (sum, count) over ranks, then divide once
        if rank == 0:  # stays near 2.30: 4 + r steps an epoch show Join, they do not train the CNN
            print(json.dumps({"epoch": epoch + 1, "train_loss": (sums[0] / sums[1]).item()}))
    # --- the check: every rank finished, with the same parameters ---
    params = torch.cat([p.detach().reshape(-1) for p in raw_model.parameters()])
    rank0_params = params.clone()
    dist.broadcast(rank0_params, src=0)  # for the check only: training never sends parameters
    torch.testing.assert_close(params, rank0_params, rtol=0, atol=0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
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
