"""Wrong: b2 added on every rank before the all-reduce: the output holds tp x b2."""

import torch

from exercises.solutions import tensor_parallel_mlp as right

CopyToParallel, ReduceFromParallel = right.CopyToParallel, right.ReduceFromParallel


class TensorParallelMLP(right.TensorParallelMLP):
    def forward(self, x):
        hidden = torch.nn.functional.gelu(CopyToParallel.apply(x) @ self.w1.T + self.b1)
        return ReduceFromParallel.apply(
            hidden @ self.w2.T + self.b2
        )  # the bug: b2 summed over ranks
