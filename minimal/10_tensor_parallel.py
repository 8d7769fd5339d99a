"""Minimal 10: tensor parallelism -- one MLP block split over the ranks, Megatron-style.

    torchrun --standalone --nproc_per_node=2 minimal/10_tensor_parallel.py
    python minimal/10_tensor_parallel.py                  # plain python: tp = 1, nothing split

fc1 (H -> 4H) is split by output features (column parallel), fc2 (4H -> H) by input features (row
parallel): rank r holds rows [r*4H/tp, (r+1)*4H/tp) of fc1's weight and those columns of fc2's; GELU
is elementwise. f (all-reduce backward: each rank has a partial gradient of x) and g (all-reduce
forward: each has a partial product) join them. The measured lesson is lessons/10_tensor_parallel.py.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

B, S, H = 32, 8, 32  # lesson 10's shapes: batch, tokens (a digit's 8 rows), features
calls = {"forward": 0, "backward": 0}  # all-reduces, to see "one each way"


class CopyToTP(torch.autograd.Function):
    """f: identity forward; backward sums the partial gradients of x over the ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()  # a copy: autograd may pass this tensor elsewhere too
        dist.all_reduce(grad)
        calls["backward"] += 1
        return grad


class ReduceFromTP(torch.autograd.Function):
    """g: forward sums the partial products over the ranks; identity backward."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        dist.all_reduce(x)
        calls["forward"] += 1
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class TPMLP(nn.Module):
    """`full` (fc1, GELU, fc2) split: f, column-parallel fc1, GELU, row-parallel fc2, g."""

    def __init__(self, full: nn.Sequential, rank: int, world_size: int):
        super().__init__()
        cut = lambda t, dim: nn.Parameter(t.detach().chunk(world_size, dim)[rank].clone())  # noqa
        self.w1, self.b1 = cut(full[0].weight, 0), cut(full[0].bias, 0)  # (4H/tp, H), (4H/tp,)
        self.w2 = cut(full[2].weight, 1)  # (H, 4H/tp)
        self.b2 = nn.Parameter(full[2].bias.detach().clone())  # (H,) whole: added once, after g

    def forward(self, x):  # x (B, S, H), the same on every rank
        x = CopyToTP.apply(x)  # f
        h = F.gelu(F.linear(x, self.w1, self.b1))  # (B, S, 4H/tp): this rank's features
        y = ReduceFromTP.apply(F.linear(h, self.w2))  # g: the sum of the ranks' partial products
        return y + self.b2  # (B, S, H)


def train(args, rank, world_size, device) -> None:
    # --- data and model ---
    torch.manual_seed(args.seed)  # every rank: the same x, the same full weights to cut from
    x = torch.randn(B, S, H, device=device)
    full = nn.Sequential(nn.Linear(H, 4 * H), nn.GELU(), nn.Linear(4 * H, H)).to(device)
    split = TPMLP(full, rank, world_size)

    # --- one forward and backward of each; the loss is a mean, as training losses are ---
    xf, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    yf, ys = full(xf), split(xs)
    for y in (yf, ys):
        y.square().mean().backward()

    # --- the check: output, input gradient and this rank's slice of every weight gradient ---
    mine = lambda t, dim: t.grad.chunk(world_size, dim)[rank]  # noqa: E731
    pairs = [(ys, yf), (xs.grad, xf.grad)]  # output, input gradient
    pairs += [(split.w1.grad, mine(full[0].weight, 0)), (split.b1.grad, mine(full[0].bias, 0))]
    pairs += [(split.w2.grad, mine(full[2].weight, 1)), (split.b2.grad, full[2].bias.grad)]
    diff = torch.stack([(a - b).abs().max() for a, b in pairs]).max()  # each rank checks its own
    if rank == 0:  # one JSON line, full precision; the loss: lesson 10's unsplit MLP at this seed
        facts = {"tp": world_size, "all_reduces": calls, "max_diff": diff.item()}
        print(json.dumps({**facts, "loss": yf.square().mean().item()}))
    assert diff <= 1e-5, f"rank {rank}: split - unsplit = {diff}"  # a NaN fails too


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
