"""Reference solution of exercises/exact_evaluation.py (lesson 05)."""

import torch
import torch.distributed as dist
from torch import nn


def global_accuracy(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_classes: int
) -> tuple[float, list[float]]:
    model.eval()
    with torch.no_grad():
        pred = model(x).argmax(dim=1)  # (n_r,); an empty shard gives an empty tensor
    right = y[pred == y]
    # per class: (correct, samples); one all-reduce of a (2, C) tensor: the sums, never the ratios
    counts = torch.stack(
        [torch.bincount(right, minlength=num_classes), torch.bincount(y, minlength=num_classes)]
    ).double()
    dist.all_reduce(counts)
    correct, total = counts
    return (correct.sum() / total.sum()).item(), (correct / total).tolist()
