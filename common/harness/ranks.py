"""Talking across ranks about results: rank-0 printing, exact metric reduction, gathering, replica checks.

Introduced in lesson 03 and used by every lesson after it. Rules these helpers encode:
- one process prints (rank 0), flushed: several ranks writing one pipe interleave byte by byte;
- metrics are reduced as (sum, count) pairs and divided once, never averaged as per-rank means;
- per-rank facts travel to rank 0 (`gather_to_rank0`) and are printed there in rank order.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from common.harness.env import DistInfo
from common.measure.differences import max_abs_diff, max_over_ranks, nan_max

__all__ = [
    "print0",
    "all_reduce_sum",
    "global_mean",
    "gather_to_rank0",
    "all_gather_objects",
    "max_param_diff_across_ranks",
    "rank0_progress",
    "peak_rss_mb",
]


def _current_rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def print0(*args, **kwargs) -> None:
    """print() on global rank 0 only, flushed (several ranks writing one pipe interleave byte by byte)."""
    if _current_rank() == 0:
        print(*args, **kwargs, flush=True)


def all_reduce_sum(values: Sequence[float], info: DistInfo) -> list[float]:
    """Sum a few numbers over all ranks; every rank gets the sums (float64, so counts stay exact).

    This is how metrics are combined: reduce (sum, count) pairs, then divide once. Averaging per-rank means
    is wrong whenever ranks hold different numbers of samples.
    """
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=info.device)
    if info.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def global_mean(value_sum: float, count: float, info: DistInfo) -> float:
    """sum over ranks of value_sum / sum over ranks of count (the same on every rank).

    Example: ranks holding 4, 3 and 3 samples with 4, 0 and 0 correct give 4/10 = 0.4, where the mean of
    per-rank accuracies would give (1 + 0 + 0)/3 = 0.333.

    Raises:
        ZeroDivisionError: no rank holds any sample.
    """
    total, n = all_reduce_sum([value_sum, count], info)
    if n == 0:
        raise ZeroDivisionError("global_mean over zero samples")
    return total / n


def gather_to_rank0(obj: object, info: DistInfo) -> list | None:
    """Collect one picklable object per rank on rank 0, in rank order; other ranks get None.

    Uses `dist.gather_object` (https://pytorch.org/docs/stable/distributed.html#torch.distributed.gather_object),
    so rank 0 can print per-rank facts in order instead of every rank printing at once.
    """
    if not info.distributed:
        return [obj]
    out = [None] * info.world_size if info.master_process else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj: object, info: DistInfo) -> list:
    """[obj of rank 0, obj of rank 1, ...] on EVERY rank (`dist.all_gather_object`), so every rank can report.

    Use it when every rank must take the same decision from all ranks' facts; `gather_to_rank0` when only rank 0
    prints them. A world of one (no process group) gets [obj].
    """
    out = [obj] * info.world_size
    if info.distributed:
        dist.all_gather_object(out, obj)
    return out


@torch.no_grad()
def max_param_diff_across_ranks(model: nn.Module, info: DistInfo) -> float:
    """Largest |p_rank - p_rank0| over every parameter and rank (0.0: bit-identical parameters;
    buffers such as BatchNorm's running statistics are not compared). NaN if any rank holds a NaN anywhere.

    Rank 0's parameters are broadcast and compared on each rank; each rank's largest difference then goes
    through `max_over_ranks`, so every rank returns the same number. Not a raw all-reduce with MAX: gloo's
    MAX drops a NaN that is not on rank 0, and a replica that diverged on rank 1 would read 0.0.
    """
    if not info.distributed:
        return 0.0
    diffs = []
    for p in model.parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, src=0)
        diffs.append(max_abs_diff(p, ref))
    return max_over_ranks(nan_max(diffs))


def rank0_progress(iterable: Iterable, info: DistInfo, **tqdm_kwargs) -> Iterable:
    """A tqdm progress bar on rank 0 when stderr is a terminal; the bare iterable otherwise.

    Captured runs (tests, notebooks, CI logs) therefore show only the lesson's deterministic per-epoch lines.
    """
    if info.master_process and sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(iterable, leave=False, **tqdm_kwargs)
    return iterable


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, in MB (Linux `ru_maxrss` is in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
