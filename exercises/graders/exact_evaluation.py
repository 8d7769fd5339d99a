"""Grader of exercises/exact_evaluation.py: 3 ranks with shards of 7, 0 and 2 samples of 3 classes against
one process: class 0 only on rank 0, class 2 only on rank 2, class 1 on both."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
from torch import nn

from exercises.graders._common import rank_failures, short

WORLD_SIZE = 3
FUNCTIONS = ["global_accuracy"]
CLASSES = 3
SHARDS = [(0, 7), (7, 7), (7, 9)]  # rank r holds samples [start, end): 7, 0 and 2 samples
LABELS = [0, 0, 0, 0, 1, 1, 1, 2, 1]
PREDICTED = [
    0,
    0,
    0,
    1,
    1,
    2,
    1,
    2,
    0,
]  # rank 0: class 0 3 of 4, class 1 2 of 3; rank 2: class 2 1 of 1,
#                                          class 1 0 of 1. Overall 6 of 9; class 1: 2 of 4 (not (2/3 + 0) / 2)


def data_and_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """9 samples whose logits the model passes through (an identity layer): its predictions are PREDICTED."""
    model = nn.Linear(CLASSES, CLASSES)
    with torch.no_grad():
        model.weight.copy_(torch.eye(CLASSES))
        model.bias.zero_()
    g = torch.Generator().manual_seed(0)
    logits = 2 * nn.functional.one_hot(torch.tensor(PREDICTED), CLASSES).float()
    x = logits + 0.1 * torch.rand(9, 3, generator=g)
    return model, x, torch.tensor(LABELS)


def on_rank(module: str) -> tuple[float, list[float]]:
    model, x, y = data_and_model()
    start, end = SHARDS[dist.get_rank()]
    model.train()
    overall, per_class = importlib.import_module(module).global_accuracy(
        model, x[start:end], y[start:end], CLASSES
    )
    return float(overall), [float(v) for v in torch.as_tensor(per_class).flatten().tolist()]


def _ratios(labels: list[int], predicted: list[int]) -> tuple[float, list[float]]:
    """(overall, per class) over these samples; NaN where there is no sample."""
    right = [p == t for p, t in zip(predicted, labels)]
    overall = sum(right) / len(labels) if labels else float("nan")
    per = [
        sum(r for r, t in zip(right, labels) if t == c) / labels.count(c)
        if c in labels
        else float("nan")
        for c in range(CLASSES)
    ]
    return overall, per


def _mean_over_ranks(values: list[float]) -> float:
    present = [v for v in values if v == v]
    return sum(present) / len(present)


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    want, want_per = _ratios(LABELS, PREDICTED)  # one process over all 9 samples
    local = [_ratios(LABELS[a:b], PREDICTED[a:b]) for a, b in SHARDS]
    for rank, (got, got_per) in enumerate(answers):
        shard = f"rank {rank} (shard of {SHARDS[rank][1] - SHARDS[rank][0]} samples)"
        if not abs(got - want) <= 1e-12:
            mean_of_means = _mean_over_ranks([o for o, _ in local])
            hint = (
                "that is the mean of the ranks' accuracies: reduce the correct count and the sample count"
                if abs(got - mean_of_means) < 1e-6
                else "every rank must return correct / total over all ranks"
            )
            return [
                f"{shard} returned {got:.4f} overall, expected {want:.4f} (6 of 9 right): {hint}"
            ]
        if len(got_per) != CLASSES:
            return [
                f"{shard} returned {len(got_per)} per-class values, expected num_classes = {CLASSES}"
            ]
        for c in range(CLASSES):
            if abs(got_per[c] - want_per[c]) <= 1e-12:
                continue
            averaged = _mean_over_ranks([per[c] for _, per in local])
            hint = (
                f"that is the mean of the ranks' accuracies on class {c}: per class, reduce the correct "
                f"count and the sample count (bincount with minlength), then divide once"
                if abs(got_per[c] - averaged) < 1e-6
                else f"per_class[{c}] is, of every rank's samples labelled {c}, the fraction predicted {c}"
            )
            return [
                f"{shard} returned per_class {short(got_per)}, expected {short(want_per)}: class {c} is "
                f"{got_per[c]:.4f}, expected {want_per[c]:.4f}: {hint}"
            ]
    return []
