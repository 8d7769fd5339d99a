"""Grader of exercises/ring_allreduce.py: 4 ranks, tensors of several lengths, against the exact sum; no
collective allowed, and the bytes each rank sends counted."""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from exercises.graders._common import close, collectives_forbidden, functions_replaced, rank_failures, short

WORLD_SIZE = 4
FUNCTIONS = ["ring_all_reduce"]
LENGTHS = (10, 3, 1001)  # 10: chunks of 3, 3, 2, 2; 3: shorter than the ring (one chunk is empty); 1001: long


def rank_tensor(rank: int, length: int) -> torch.Tensor:
    """What rank `rank` starts with: different on every rank, so that a missing contribution shows."""
    return (torch.arange(length, dtype=torch.float64) + 1) * (rank + 1) + 0.25 * rank


def expected(length: int, world_size: int) -> torch.Tensor:
    """The sum over ranks, computed without any collective (so a grader never waits on a learner's bug)."""
    return sum(rank_tensor(r, length) for r in range(world_size))


def counting_sends(sent: list[int]):
    """isend and send (also as the op of a P2POp) that add the bytes they send to sent[0]."""
    def wrap(original):
        def call(tensor, *args, **kwargs):
            sent[0] += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)
        call.__name__ = original.__name__  # P2POp's repr reads it
        return call
    return {c10d.isend: wrap(c10d.isend), c10d.send: wrap(c10d.send)}


def on_rank(module: str) -> list[list[float]]:
    learner = importlib.import_module(module)
    out = []
    for length in LENGTHS:
        x = rank_tensor(dist.get_rank(), length)
        sent = [0]
        with collectives_forbidden("build the sum from isend/irecv only", [learner]), \
                functions_replaced(counting_sends(sent), [learner]):
            learner.ring_all_reduce(x)
        out.append((x.tolist(), sent[0]))
    return out


def most_bytes(length: int, world_size: int) -> int:
    """What one rank of a ring all-reduce sends at most: 2 (n - 1) chunks of at most ceil(L / n) elements,
    about 2 (n - 1) / n x the tensor."""
    return 2 * (world_size - 1) * -(-length // world_size) * 8


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
        for rank, (got, sent) in enumerate(a[i] for a in answers):
            if close(got, want, 1e-9):
                if sent > most_bytes(length, n):
                    problems.append(f"length {length}: rank {rank} sent {sent} bytes for a tensor of "
                                    f"{length * 8}; a ring all-reduce sends 2(n-1)/n x the tensor, at most "
                                    f"{most_bytes(length, n)} here: send one chunk of "
                                    f"torch.tensor_split(tensor, n) per step, not the whole tensor")
                    break
                continue
            start = rank_tensor(rank, length)
            if close(got, start, 0.0):
                hint = "its tensor is unchanged: write what you receive into the chunk views of `tensor`"
            else:
                hint = ("did every rank send to rank + 1 and receive from rank - 1, with n - 1 steps of "
                        "reduce-scatter (add) then n - 1 of all-gather (copy)?")
            problems.append(f"length {length}: rank {rank} holds {short(got)}, expected {short(want)}: "
                            f"{hint}")
            break
    return problems
