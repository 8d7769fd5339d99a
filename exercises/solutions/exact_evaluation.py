"""Reference solution of exercises/exact_evaluation.py (lesson 05)."""
import torch
import torch.distributed as dist
from torch import nn


def global_accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(dim=1) == y).sum() if len(y) else torch.tensor(0)
    counts = torch.tensor([float(correct), float(len(y))], dtype=torch.float64)  # (correct, total)
    dist.all_reduce(counts)  # one message: both sums at once
    return (counts[0] / counts[1]).item()
