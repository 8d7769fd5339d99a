"""A split module held to the unsplit one it was cut from: outputs, gradients and collectives (lesson 10).

`split_vs_unsplit` runs both on the same input with the same loss and returns the largest difference over
output, input gradient and weight gradients (gathered over the ranks, NaN-safe), together with the collectives
a counter saw in the split module's forward and backward: `common.measure.counters.count_collectives` for the
hand-built layers of `common.tensor_parallel.layers`, `common.measure.dtensor_counts.count_dtensor_collectives`
for DTensor's (`parallelize_module`).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from common.harness.grid import Grid
from common.measure.differences import max_abs_diff, max_over_ranks, nan_max
from common.tensor_parallel.layers import max_shard_diff

__all__ = ["split_vs_unsplit", "weight_bytes", "placements"]


def split_vs_unsplit(full, split, x, grid: Grid, counter, shard_seq: bool = False):
    """Run both on x (B, S, H) with the loss sum(y**2) / (B*S*H); return the largest difference (over all
    ranks) of output, input gradient and weight gradients, and the collectives `counter` saw in the split
    forward and backward.
    shard_seq: the split module reads and writes this rank's S/tp tokens (sequence parallelism)."""
    tp_rank, tp = grid.coords["tp"], grid.size("tp")

    def cut(t: torch.Tensor) -> torch.Tensor:  # (B, S, H) -> (B, S/tp, H) with sequence parallelism
        return t.chunk(tp, 1)[tp_rank] if shard_seq else t

    xf = x.clone().requires_grad_()
    yf = full(xf)
    yf.square().sum().div(yf.numel()).backward()  # a mean, as training losses are: O(1) gradients
    xs = cut(x).clone().requires_grad_()
    with counter() as fwd:
        ys = split(xs)
    with counter() as bwd:
        # divided by the unsplit numel: the same per-element gradient with S/tp tokens
        ys.square().sum().div(yf.numel()).backward()
    # NaN-safe: a NaN anywhere makes the difference NaN, and the claim fails (common/measure/differences.py).
    # DTensor gradients are compared whole: full_tensor() sums a Partial one.
    diffs = [
        max_abs_diff(ys, cut(yf)),
        max_abs_diff(xs.grad, cut(xf.grad)),
        max_shard_diff(full, split, tp_rank, grads=True),
    ]
    return max_over_ranks(nan_max(diffs)), fwd, bwd


def weight_bytes(module: nn.Module) -> int:
    """Bytes of the weight matrices this rank holds (biases left out)."""
    weights = [p for n, p in module.named_parameters() if n.endswith("weight")]
    return sum(p.numel() * p.element_size() for p in weights)


def placements(module: nn.Module) -> dict[str, str]:
    """{parameter name: its DTensor placement}, e.g. {"fc1.weight": "Shard(dim=0)", "fc2.bias": "Replicate()"}
    (one placement per mesh dimension; the tp mesh has one)."""
    return {n: ", ".join(map(repr, p.placements)) for n, p in module.named_parameters()}
