"""Minimal 11: hybrid parallelism -- a 2-D grid of ranks: data parallel x tensor parallel.

    torchrun --standalone --nproc_per_node=4 minimal/11_hybrid_parallel.py
    python minimal/11_hybrid_parallel.py                            # plain python: a 1 x 1 grid

Ranks form a grid arange(world_size).view(dp, tp). A row is a tp group: it holds one replica (the
MLP of minimal/10 split over it) and sees one micro-batch. A column is a dp group: the replicas
average gradients in it. The check: equal to one process. Lesson: lessons/11_hybrid_parallel.py.
"""

import argparse
import copy
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class CopyToTP(torch.autograd.Function):  # f: identity forward, all-reduce backward
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTP(torch.autograd.Function):  # g: all-reduce forward, identity backward
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPMLP(nn.Module):  # minimal/10's: f, column-parallel fc1, GELU, row-parallel fc2, g
    def __init__(self, full: nn.Sequential, tp_rank: int, tp: int, group):
        super().__init__()
        self.group = group  # the tp group: f and g all-reduce in it
        cut = lambda t, dim: nn.Parameter(t.detach().chunk(tp, dim)[tp_rank].clone())  # noqa
        self.w1, self.b1 = cut(full[0].weight, 0), cut(full[0].bias, 0)  # (256/tp, 64), (256/tp,)
        self.w2 = cut(full[2].weight, 1)  # (10, 256/tp); the bias b2 (10,) whole, added after g
        self.b2 = nn.Parameter(full[2].bias.detach().clone())

    def forward(self, x):  # x (b, 64), the same on every rank of the tp group
        h = F.gelu(F.linear(CopyToTP.apply(x, self.group), self.w1, self.b1))  # (b, 256/tp)
        return ReduceFromTP.apply(F.linear(h, self.w2), self.group) + self.b2  # (b, 10)


def train(args, rank, world_size, device) -> None:
    # --- the grid: every rank creates every group, in the same order ---
    tp = 2 if world_size % 2 == 0 else 1  # 4 ranks: dp=2 x tp=2; 2 ranks: 1 x 2
    grid = torch.arange(world_size).view(-1, tp)  # (dp, tp): rank = dp_rank * tp + tp_rank
    dp, (dp_rank, tp_rank) = len(grid), divmod(rank, tp)
    if 32 % dp:  # 3 ranks: 11 + 11 + 10, and a mean of the replicas' means is not the batch mean
        raise SystemExit(f"dp = {dp} must divide the global batch of 32 ({world_size} processes)")
    tp_group = [dist.new_group(row) for row in grid.tolist()][dp_rank]  # my row
    dp_group = [dist.new_group(col) for col in grid.t().tolist()][tp_rank]  # my column
    # --- data and models ---
    g = torch.Generator().manual_seed(args.seed)  # the same 5 global batches of 32 on every rank
    images, labels = torch.randn(5, 32, 64, generator=g), torch.randint(10, (5, 32), generator=g)
    torch.manual_seed(args.seed)  # the same full weights on every rank, to cut shards from
    stem = nn.Sequential(nn.Linear(64, 64), nn.GELU()).to(device)  # replicated on every rank
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).to(device)  # split, tp
    full = nn.Sequential(stem, mlp)  # the one-process model
    model = nn.Sequential(copy.deepcopy(stem), TPMLP(mlp, tp_rank, tp, tp_group))
    optimizer = torch.optim.SGD([*full.parameters(), *model.parameters()], lr=0.1)
    # --- the training loop: `full` as one process on the global batch, `model` on my 1/dp ---
    for x, y in zip(images.to(device), labels.to(device)):  # (32, 64), (32,)
        optimizer.zero_grad()
        F.cross_entropy(full(x), y).backward()
        F.cross_entropy(model(x.chunk(dp)[dp_rank]), y.chunk(dp)[dp_rank]).backward()
        for p in model.parameters():  # average over the replicas (/ dp, then sum), as DDP does
            dist.all_reduce(p.grad.div_(dp), group=dp_group)
        optimizer.step()
    # --- the check: every parameter equals the one-process model's, cut the same way ---
    want = nn.Sequential(stem, TPMLP(mlp, tp_rank, tp, tp_group)).parameters()
    diff = torch.stack([(a - b).abs().max() for a, b in zip(model.parameters(), want)]).max()
    if rank == 0:  # one JSON line: the grid's groups and the check (each rank checks its own below)
        groups = {"tp_groups": grid.tolist(), "dp_groups": grid.t().tolist()}
        print(json.dumps({"dp": dp, "tp": tp, **groups, "max_diff": diff.item()}))
    assert diff <= 1e-5, f"rank {rank}: max |parameter - one process| = {diff}"  # a NaN fails too


def main() -> None:
    p = argparse.ArgumentParser()
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
