"""Exercise (lesson 10): a column- then row-parallel MLP, with the two autograd functions that make it exact.

Fill in the two functions and the module, then grade them:  python -m exercises tensor_parallel_mlp
(2 gloo processes; output, input gradient and every shard's weight gradient are compared with the unsplit
MLP).
"""

import torch
import torch.distributed as dist
from torch import nn


class CopyToParallel(torch.autograd.Function):
    """f: identity in forward (every rank already holds the whole input); all-reduce (sum) of the input's
    gradient in backward (each rank's half of the MLP contributes to it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("CopyToParallel.forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("CopyToParallel.backward")


class ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce (sum) of the partial outputs in forward; identity in backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("ReduceFromParallel.forward")

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("ReduceFromParallel.backward")


class TensorParallelMLP(nn.Module):
    """This rank's part of `fc2(gelu(fc1(x)))` split over the tp ranks (the default process group).

    Contract:
        fc1: nn.Linear(d, h), fc2: nn.Linear(h, d), the whole layers (the same on every rank); h divides by
        the world size tp. Keep as parameters (nn.Parameter, copies, not views of fc1/fc2):
            self.w1: rows [r*h/tp, (r+1)*h/tp) of fc1.weight (h/tp, d) and self.b1: the same slice of fc1.bias
            (column parallel: each rank computes h/tp of the hidden units, no communication needed);
            self.w2: columns [r*h/tp, (r+1)*h/tp) of fc2.weight (d, h/tp) and self.b2 = fc2.bias (d,)
            (row parallel: each rank's partial output sums to the whole).
        forward(x) with x (B, d), the same on every rank, returns fc2(gelu(fc1(x))) (B, d) on every rank.

    Hint: x -> f -> column linear -> gelu -> row linear -> g -> + b2. Add b2 AFTER the all-reduce (once,
    not tp times).
    """

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear):
        super().__init__()
        raise NotImplementedError("TensorParallelMLP.__init__")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("TensorParallelMLP.forward")
