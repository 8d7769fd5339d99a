"""Minimal 06: SyncBatchNorm -- BatchNorm statistics of the global batch, from all-reduced sums.

    torchrun --standalone --nproc_per_node=2 minimal/06_sync_batchnorm.py --epochs 2

Under DDP a BatchNorm normalises with THIS rank's micro-batch; SyncBatchNorm2d all-reduces [count,
sum, sum of squares] per channel (and its gradients in backward). nn.SyncBatchNorm: GPUs only."""

import argparse
import json
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


class AllReduceSum(torch.autograd.Function):  # dist.all_reduce with a gradient
    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        t = t.clone()  # out of place: autograd may need the input
        dist.all_reduce(t)
        return t

    backward = forward  # my input fed every rank's sum: its gradient adds every rank's gradient


class SyncBatchNorm2d(nn.BatchNorm2d):  # training statistics of the global batch, all ranks
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, C, H, W), B on this rank
        if not self.training:
            return super().forward(x)  # evaluation uses the running statistics: nothing to share
        xc = x.double().transpose(0, 1).flatten(1)  # (C, B*H*W), float64: E[x^2] - E[x]^2 cancels
        local = torch.stack([xc.new_full((len(xc),), xc.size(1)), xc.sum(1), (xc * xc).sum(1)])
        n, sum_x, sum_x2 = AllReduceSum.apply(local)  # count, sum, sum of squares over all ranks
        mean, var = sum_x / n, sum_x2 / n - (sum_x / n) ** 2  # (C,) biased variance: normalises
        self.running_mean.lerp_(mean.detach().float(), self.momentum)  # as BatchNorm keeps them,
        self.running_var.lerp_((var * n / (n - 1)).detach().float(), self.momentum)  # unbiased
        x_hat = (x - mean.float().view(-1, 1, 1)) * (var.float().view(-1, 1, 1) + self.eps).rsqrt()
        return x_hat * self.weight.view(-1, 1, 1) + self.bias.view(-1, 1, 1)


def make_model() -> nn.Module:
    """The lessons' DigitsCNN with SyncBatchNorm2d: in BEFORE the DDP wrap records the layers."""
    return nn.Sequential(  # x (B, 1, 8, 8) -> logits (B, 10), ~38k parameters
        nn.Conv2d(1, 16, 3, padding=1, bias=False),
        SyncBatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        SyncBatchNorm2d(32),
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
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)  # 32 per process
    model = DDP(make_model().to(device))  # device_ids may be None: the module is on one device
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new order every epoch (without it: epoch 0's order forever)
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(device)), y.to(device))  # mean over the B samples
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces (averages) the gradients, bucket by bucket
            optimizer.step()  # every rank applies the same averaged gradient
        if rank == 0:  # one JSON line per epoch, full precision: a test compares it with the lesson
            print(json.dumps({"epoch": epoch + 1, "last_loss": loss.item()}))  # rank 0's last step
    x, w = torch.randn(2, 4 * world_size, 16, 8, 8, device=device)  # the check: 1 global batch
    sync, plain = SyncBatchNorm2d(16).to(device), nn.BatchNorm2d(16).to(device)
    mine = x.chunk(world_size)[rank].requires_grad_()  # this rank's 4 samples, its share of a loss
    (sync(mine) * w.chunk(world_size)[rank]).sum().backward()
    (plain(x.requires_grad_()) * w).sum().backward()  # one process, the whole global batch
    torch.testing.assert_close(mine.grad, x.grad.chunk(world_size)[rank])  # SyncBatchNorm2d is
    torch.testing.assert_close(list(sync.buffers())[:2], list(plain.buffers())[:2])  # BatchNorm2d


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
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
