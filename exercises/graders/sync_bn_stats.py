"""Grader of exercises/sync_bn_stats.py: 3 ranks with batches of 2, 5 and 1, against the whole batch, in two
cases: float64 batches whose means differ between ranks, and float32 batches near 300 with a spread of 0.05
(where E[x^2] - E[x]^2 in float32 cancels to noise)."""

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from exercises.graders._common import answer_diff, close, rank_failures, short

WORLD_SIZE = 3
FUNCTIONS = ["global_mean_var"]
BATCHES = (2, 5, 1)
# case -> (tolerance of the mean, of the variance). float32 rounds a mean near 300 to ~3e-5; a stable
# float32 variance is within ~1e-9 of the truth (2.5e-3), sum_sq / count - mean^2 in float32 off by ~1e-2.
CASES = {"float64": (1e-9, 1e-9), "float32": (1.2e-4, 1e-6)}


def rank_batch(rank: int, case: str = "float64") -> torch.Tensor:
    """Rank r's (N_r, 3, 4, 4) batch: float64 with a mean that differs from rank to rank (as real shards'
    do), or float32 values near 300 with a spread of 0.05 (an input that was never normalised)."""
    if case == "float64":
        g = torch.Generator().manual_seed(10 + rank)
        return (
            torch.randn(BATCHES[rank], 3, 4, 4, generator=g, dtype=torch.float64) * (1 + rank)
            + 2.0 * rank
        )
    g = torch.Generator().manual_seed(20 + rank)
    x = (
        300.0
        + 0.05 * torch.randn(BATCHES[rank], 3, 4, 4, generator=g, dtype=torch.float64)
        + 0.01 * rank
    )
    return x.float()


def on_rank(module: str) -> dict[str, tuple[list[float], list[float]]]:
    fn = importlib.import_module(module).global_mean_var
    out = {}
    for case in CASES:
        mean, var = fn(rank_batch(dist.get_rank(), case))
        out[case] = (torch.as_tensor(mean).tolist(), torch.as_tensor(var).tolist())
    return out


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if problems:
        return problems
    for case, (mean_tol, var_tol) in CASES.items():
        whole = torch.cat([rank_batch(r, case) for r in range(len(answers))]).double()
        var, mean = torch.var_mean(whole, dim=(0, 2, 3), unbiased=False)
        what = "float64 batches" if case == "float64" else "float32 batches near 300, spread 0.05"
        for rank, a in enumerate(answers):
            got_mean, got_var = a[case]
            if not close(got_mean, mean, mean_tol):
                return [
                    f"{what}: rank {rank}: mean {short(got_mean)}, expected {short(mean.tolist())}: "
                    f"weigh each rank by its count (reduce sums and counts, not means)"
                ]
            if close(got_var, var, var_tol):
                continue
            head = (
                f"{what}: rank {rank}: var {short(got_var)}, expected {short(var.tolist())} (biased, "
                f"over all {len(whole)} samples)"
            )
            if case == "float32":
                off = answer_diff(got_var, var)
                return [
                    f"{head}, off by {off:.2g}: sum_sq / count - mean^2 cancels in "
                    f"float32 (both terms ~9e4, float32 keeps 7 digits): once the mean is reduced, "
                    f"reduce the squared deviations from it (or accumulate in float64)"
                ]
            return [
                f"{head}: the spread between the ranks' means counts too: reduce the sum of squares (or "
                f"of the squared deviations from the global mean), not the ranks' variances"
            ]
    return []
