"""Reference solution of exercises/tensor_parallel_mlp.py (lesson 10)."""

import torch
import torch.distributed as dist
from torch import nn


class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)  # each rank's shard contributed part of dL/dx
        return grad


class ReduceFromParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)  # the partial outputs of the row-parallel layer sum to the whole
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class TensorParallelMLP(nn.Module):
    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        rank, tp = dist.get_rank(), dist.get_world_size()
        part = fc1.out_features // tp
        rows = slice(rank * part, (rank + 1) * part)
        self.w1 = nn.Parameter(fc1.weight.detach()[rows].clone())  # (h/tp, d): column parallel
        self.b1 = nn.Parameter(fc1.bias.detach()[rows].clone())  # (h/tp,)
        self.w2 = nn.Parameter(fc2.weight.detach()[:, rows].clone())  # (d, h/tp): row parallel
        self.b2 = nn.Parameter(fc2.bias.detach().clone())  # (d,), added once after the sum

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToParallel.apply(x)  # (B, d) on every rank
        hidden = nn.functional.gelu(x @ self.w1.T + self.b1)  # (B, h/tp): this rank's hidden units
        partial = hidden @ self.w2.T  # (B, d): this rank's share of out
        return ReduceFromParallel.apply(partial) + self.b2
