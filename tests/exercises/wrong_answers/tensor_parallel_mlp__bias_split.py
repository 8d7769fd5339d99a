"""Wrong: each rank adds b2 / tp before the all-reduce: the output is right, but b2's gradient is 1/tp of
the unsplit layer's."""

import torch
import torch.distributed as dist

from exercises.solutions import tensor_parallel_mlp as right

CopyToParallel, ReduceFromParallel = right.CopyToParallel, right.ReduceFromParallel


class TensorParallelMLP(right.TensorParallelMLP):
    def forward(self, x):
        hidden = torch.nn.functional.gelu(CopyToParallel.apply(x) @ self.w1.T + self.b1)
        share = self.b2 / dist.get_world_size()  # the bug: the bias's gradient shrinks with it
        return ReduceFromParallel.apply(hidden @ self.w2.T + share)
