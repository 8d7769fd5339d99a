"""Grader of exercises/ring_allreduce.py: 4 ranks, tensors of several lengths, against the exact sum."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist

from exercises.graders._common import close, collectives_forbidden, rank_failures, short

WORLD_SIZE = 4
FUNCTIONS = ["ring_all_reduce"]
LENGTHS = (10, 3, 1001)  # 10: chunks of 3, 3, 2, 2; 3: shorter than the ring (one chunk is empty); 1001: long


def rank_tensor(rank: int, length: int) -> torch.Tensor:
    """What rank `rank` starts with: different on every rank, so that a missing contribution shows."""
    return (torch.arange(length, dtype=torch.float64) + 1) * (rank + 1) + 0.25 * rank


def expected(length: int, world_size: int) -> torch.Tensor:
    """The sum over ranks, computed without any collective (so a grader never waits on a learner's bug)."""
    return sum(rank_tensor(r, length) for r in range(world_size))


def on_rank(module: str) -> list[list[float]]:
    ring_all_reduce = importlib.import_module(module).ring_all_reduce
    out = []
    for length in LENGTHS:
        x = rank_tensor(dist.get_rank(), length)
        with collectives_forbidden("build the sum from isend/irecv only"):
            ring_all_reduce(x)
        out.append(x.tolist())
    return out


def judge(answers: list) -> list[str]:
    problems = rank_failures(answers)
    if any("size" in p for p in problems):
        problems.append("a rank received a chunk of another size than it posted for: at each step, rank r "
                        "must send to rank + 1 the chunk that rank + 1 receives from rank - 1")
    if problems:
        return problems
    n = len(answers)
    for i, length in enumerate(LENGTHS):
        want = expected(length, n)
        for rank, got in enumerate(answers):
            if close(got[i], want, 1e-9):
                continue
            start = rank_tensor(rank, length)
            if close(got[i], start, 0.0):
                hint = "its tensor is unchanged: write what you receive into the chunk views of `tensor`"
            else:
                hint = ("did every rank send to rank + 1 and receive from rank - 1, with n - 1 steps of "
                        "reduce-scatter (add) then n - 1 of all-gather (copy)?")
            problems.append(f"length {length}: rank {rank} holds {short(got[i])}, expected {short(want)}: "
                            f"{hint}")
            break
    return problems
