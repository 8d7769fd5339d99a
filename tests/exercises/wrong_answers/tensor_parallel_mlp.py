"""Wrong: f's backward does not all-reduce the input's gradient."""

import torch

from exercises.solutions import tensor_parallel_mlp as right


class CopyToParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad  # the bug: each rank keeps only its half's contribution


ReduceFromParallel = right.ReduceFromParallel


class TensorParallelMLP(right.TensorParallelMLP):
    def forward(self, x):
        x = CopyToParallel.apply(x)
        hidden = torch.nn.functional.gelu(x @ self.w1.T + self.b1)
        return ReduceFromParallel.apply(hidden @ self.w2.T) + self.b2
