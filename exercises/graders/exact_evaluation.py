"""Grader of exercises/exact_evaluation.py: 3 ranks with shards of 7, 0 and 2 samples against one process."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn

from exercises.graders._common import rank_failures

WORLD_SIZE = 3
FUNCTIONS = ["global_accuracy"]
SHARDS = [(0, 7), (7, 7), (7, 9)]  # rank r holds samples [start, end): 7, 0 and 2 samples


def data_and_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """9 samples of 4 features, a fixed linear model: 5 of the first 7 and 0 of the last 2 are right."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    x = torch.randn(9, 4)
    pred = model(x).argmax(dim=1).detach()
    y = pred.clone()
    y[[1, 4]] = (pred[[1, 4]] + 1) % 3  # 2 wrong among the first 7 (5 of 7 right on rank 0)
    y[7:] = (pred[7:] + 1) % 3          # both wrong on rank 2 (0 of 2)
    return model, x, y


def on_rank(module: str) -> float:
    model, x, y = data_and_model()
    start, end = SHARDS[dist.get_rank()]
    model.train()
    return float(importlib.import_module(module).global_accuracy(model, x[start:end], y[start:end]))


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    want = 5 / 9  # one process over all 9 samples
    for rank, got in enumerate(answers):
        if not abs(got - want) <= 1e-12:
            mean_of_means = (5 / 7 + 0 / 2) / 2
            hint = ("that is the mean of the ranks' accuracies: reduce the correct count and the sample count"
                    if abs(got - mean_of_means) < 1e-9
                    else "every rank must return correct / total over all ranks")
            return [f"rank {rank} (shard of {SHARDS[rank][1] - SHARDS[rank][0]} samples) returned {got:.4f}, "
                    f"expected {want:.4f} (5 of 9 right): {hint}"]
    return []
