"""Grader of exercises/sync_bn_stats.py: 3 ranks with batches of 2, 5 and 1, against the whole batch."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from exercises.graders._common import close, rank_failures, short

WORLD_SIZE = 3
FUNCTIONS = ["global_mean_var"]
BATCHES = (2, 5, 1)


def rank_batch(rank: int) -> torch.Tensor:
    """Rank r's (N_r, 3, 4, 4) batch, with a mean that differs from rank to rank (as real shards' do)."""
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(BATCHES[rank], 3, 4, 4, generator=g, dtype=torch.float64) * (1 + rank) + 2.0 * rank


def on_rank(module: str) -> tuple[list[float], list[float]]:
    mean, var = importlib.import_module(module).global_mean_var(rank_batch(dist.get_rank()))
    return mean.tolist(), var.tolist()


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    whole = torch.cat([rank_batch(r) for r in range(len(answers))])
    var, mean = torch.var_mean(whole, dim=(0, 2, 3), unbiased=False)
    for rank, (got_mean, got_var) in enumerate(answers):
        if not close(got_mean, mean, 1e-9):
            return [f"rank {rank}: mean {short(got_mean)}, expected {short(mean.tolist())}: "
                    f"weigh each rank by "
                    f"its count (reduce sums and counts, not means)"]
        if not close(got_var, var, 1e-9):
            return [f"rank {rank}: var {short(got_var)}, expected {short(var.tolist())} (biased, over all "
                    f"{len(whole)} samples): reduce the sum of squares, then E[x^2] - mean^2"]
    return []
